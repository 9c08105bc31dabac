"""``[task.scorer] type = "judge"``: a frozen generative judge as a scorer executor.

The judge is a causal LM (a local Hugging Face folder or a ``tiny:`` spec). For each
(prompt, completion, row) it reads ``prompt_template`` filled in with ``prompt``,
``completion`` and the row's columns (through its chat template as a user turn, when it has
one), writes a judgement greedily, and ``parser`` turns the judgement's text into a float. A
judgement the parser cannot read (it raises or returns None) is a counted scoring failure,
``judge_unparsed``, whose message holds the judge's text; never a silent 0.
"""

from __future__ import annotations

import logging
from typing import Any

from loomrl.scoring.base import ScoreItem
from loomrl.scoring.batched import BatchedModelScorer, load_frozen, resolve_placement
from loomrl.scoring.calls import RewardFailure, _safe_repr, load_object
from loomrl.scoring.config import JudgeScorerConfig

logger = logging.getLogger(__name__)

TEXT_SHOWN = 300  # characters of a judgement a failure's message shows


def judge_prompt(template: str, item: ScoreItem) -> str:
    """``template`` filled in for one item; ``RewardFailure('judge_template')`` when it
    names a column the row lacks."""
    prompt, completion, row = item
    try:
        return template.format(**{**row, "prompt": prompt, "completion": completion})
    except (KeyError, IndexError, ValueError) as err:
        raise RewardFailure(
            "judge_template",
            f"task.scorer.prompt_template cannot be filled in for this row "
            f"(columns {sorted(row)}): {type(err).__name__}: {err}",
        ) from None


def parse_judgement(parser: Any, text: str) -> float | RewardFailure:
    """The parser's number for ``text``, or the ``judge_unparsed`` failure that shows it."""
    try:
        value = parser(text)
    except Exception as err:  # noqa: BLE001 - user code: any error is an unparsed judgement
        return RewardFailure(
            "judge_unparsed",
            f"the judge's text was not parsed ({type(err).__name__}: {err}): {text[:TEXT_SHOWN]!r}",
        )
    if value is None:
        return RewardFailure(
            "judge_unparsed",
            f"the judge's text was not parsed (the parser returned None): {text[:TEXT_SHOWN]!r}",
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return RewardFailure(
            "invalid",
            f"the judge parser returned {_safe_repr(value)} for {text[:TEXT_SHOWN]!r}, "
            "expected a float",
        )
    return value


class JudgeScorer(BatchedModelScorer):
    """Scores each (prompt, completion, row) by a frozen judge's greedy judgement."""

    def __init__(self, cfg: JudgeScorerConfig) -> None:
        # lazy: transformers loads in the scorer executor, not when the job is assembled
        from loomrl.models.loading import load_model_and_tokenizer, model_context_length

        super().__init__()
        self.cfg, self.max_tokens_per_batch = cfg, cfg.max_tokens_per_batch
        self.parser = load_object(cfg.parser)
        if not callable(self.parser):
            raise TypeError(f"task.scorer.parser {cfg.parser!r} is not callable")
        self.device, dtype = resolve_placement(cfg)
        model, self.tokenizer = load_model_and_tokenizer(cfg.path, dtype=dtype)
        self.model = load_frozen(model, self.device, dtype)
        self.max_length = model_context_length(cfg.path)
        logger.info("judge %s on %s (%s)", cfg.path, self.device, dtype)

    def encode(self, item: ScoreItem) -> list[int]:
        text = judge_prompt(self.cfg.prompt_template, item)
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
        else:
            ids = self.tokenizer(text).input_ids
        if self.max_length is not None and len(ids) + self.cfg.max_new_tokens > self.max_length:
            raise RewardFailure(
                "too_long",
                f"the judge reads at most {self.max_length} tokens; this judge prompt is "
                f"{len(ids)} and task.scorer.max_new_tokens {self.cfg.max_new_tokens}",
            )
        return ids

    def score_batch(
        self, ids: list[list[int]], items: list[ScoreItem]
    ) -> list[float | RewardFailure]:
        return [parse_judgement(self.parser, text) for text in self.judge(ids)]

    def judge(self, ids: list[list[int]]) -> list[str]:
        """The judge's greedy texts for prompts given as token ids (left-padded together)."""
        # lazy: torch loads when this runs, not with the module
        import torch

        longest, pad = max(map(len, ids)), self.tokenizer.pad_token_id
        input_ids = torch.tensor(
            [[pad] * (longest - len(row)) + row for row in ids], device=self.device
        )
        mask = torch.tensor(
            [[0] * (longest - len(row)) + [1] * len(row) for row in ids], device=self.device
        )
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=self.cfg.max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        return self.tokenizer.batch_decode(out[:, longest:], skip_special_tokens=True)
