"""Prompt tokens for the controller: each training prompt encoded once per run, the held-out
prompts once, at the first evaluation; and the tokenizer's other two jobs on the loop
(an episode's turns, completions an engine left undecoded)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from loomrl.chat import PromptEncoder
from loomrl.config import DataConfig
from loomrl.prompt_fit import truncate_ids

PROMPT_CACHE_ROWS = 100_000  # training rows whose prompt ids the controller keeps between epochs


class PromptCache:
    """Training rows' prompt ids (texts or messages, through the chat template as
    ``data.chat_template`` says), each cut to ``max_prompt_tokens``. A dataset of up to
    ``PROMPT_CACHE_ROWS`` rows is encoded whole at the start (as a trainer tokenizes its
    dataset before it starts), not a few prompts per request on the loop while the
    executors run; a larger one a request at a time, keeping only recent rows."""

    def __init__(
        self,
        tokenizer: Any,
        data: DataConfig,
        model: str,
        rows: list[dict[str, Any]],
        max_prompt_tokens: int | None,
        encode_all: bool = True,
    ) -> None:
        self.tokenizer, self.rows, self.key = tokenizer, rows, data.prompt_key
        # prompts past it are cut (data.truncate_prompts)
        self.max_prompt_tokens = max_prompt_tokens
        self._encoder = PromptEncoder(tokenizer, data, model)
        self.ids: dict[int, list[int]] = {}  # training row -> prompt tokens, encoded once
        self._eval_ids: list[list[int]] | None = None
        if encode_all and len(rows) <= PROMPT_CACHE_ROWS:
            self.encode_rows(range(len(rows)))
        self.complete = len(self.ids) == len(rows)  # (then a request never looks)

    def of_rows(self, indices: list[int]) -> dict[int, list[int]]:
        """The ids of every row in ``indices`` (encoded now if they were not yet), by row."""
        if not self.complete:
            self.encode_rows(indices)
        return self.ids

    def encode_rows(self, indices: Iterable[int]) -> None:
        """Encode the rows' prompts not encoded yet, in one tokenizer call; each is encoded
        once per run (epochs and groups share the ids; nothing downstream changes them)."""
        new = [i for i in dict.fromkeys(indices) if i not in self.ids]
        if not new:
            return
        if len(self.ids) + len(new) > PROMPT_CACHE_ROWS:  # a huge dataset: keep only recent rows
            self.ids.clear()
            new = list(dict.fromkeys(indices))
        self.ids.update(zip(new, self.encode([self.rows[i][self.key] for i in new])))

    def eval_ids(self, eval_rows: list[dict[str, Any]]) -> list[list[int]]:
        """The held-out prompts' ids, encoded in one tokenizer call at the first evaluation
        and kept (every evaluation asks the same prompts)."""
        if self._eval_ids is None:
            self._eval_ids = self.encode([r[self.key] for r in eval_rows])
        return self._eval_ids

    def encode(self, prompts: list) -> list[list[int]]:
        return [
            truncate_ids(ids, self.max_prompt_tokens, self.tokenizer.bos_token_id)
            for ids in self._encoder.encode(prompts)
        ]

    def encode_text(self, text: str) -> list[int]:
        """A turn's text as ids (an episode's observations), not cut."""
        return self.tokenizer(text).input_ids

    def prompt_text(self, ids: list[int]) -> str:
        """A prompt's ids as the text the model saw, special tokens included."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_batch(self, ids: list[list[int]]) -> list[str]:
        """Completions' text, for an engine that did not detokenize them."""
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)
