"""Prompts into token ids: plain text as the tokenizer encodes it, or messages through the
tokenizer's chat template.

A templated prompt is rendered to text with the generation prompt (the assistant turn's
opening) and tokenized with no special tokens added: the template writes its own BOS, and
the tokenizer's own would make two (``[bos, bos, ...]``, the model's first position out of
its training distribution). The reward still gets the prompt as the dataset holds it.
"""

from __future__ import annotations

from typing import Any

from loomrl.config import DataConfig
from loomrl.data import DatasetError
from loomrl.prompt_fit import encode_texts

Prompt = (
    str | list[dict[str, str]]
)  # a text, or {role, content} messages (TRL's conversational format)


class PromptEncoder:
    """Renders and encodes the dataset's prompts as ``data.chat_template`` and
    ``data.system_prompt`` say."""

    def __init__(self, tokenizer: Any, data: DataConfig, model: str = "the model") -> None:
        self.tokenizer, self.mode, self.system_prompt = (
            tokenizer,
            data.chat_template,
            data.system_prompt,
        )
        self.model = model  # for messages: the model path

    def templated(self, prompt: Prompt) -> bool:
        """Whether ``prompt`` goes through the chat template."""
        if self.mode == "auto":
            return isinstance(prompt, list) or self.system_prompt is not None
        if isinstance(prompt, list) and not self.mode:
            raise DatasetError(
                "a prompt is a list of messages but data.chat_template=false; set it to 'auto' or true"
            )
        return bool(self.mode)

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The prompt as messages, with the system prompt first (unless it has its own)."""
        messages = (
            list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        )
        if self.system_prompt is not None and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def render(self, prompt: Prompt) -> str:
        """The text the model sees for ``prompt`` (templated or as is)."""
        if not self.templated(prompt):
            return prompt  # type: ignore[return-value]
        if not getattr(self.tokenizer, "chat_template", None):
            raise DatasetError(
                f"{self.model}'s tokenizer has no chat template, needed for message-list prompts, "
                "data.system_prompt or data.chat_template=true: use an instruct model's folder (its "
                "tokenizer_config.json has 'chat_template'), or plain-text prompts"
            )
        return self.tokenizer.apply_chat_template(
            self.messages(prompt), tokenize=False, add_generation_prompt=True
        )

    def encode(self, prompts: list[Prompt]) -> list[list[int]]:
        """Each prompt's ids: plain ones as the tokenizer encodes them (its BOS added),
        templated ones with no special tokens added; one tokenizer call for each kind."""
        flags = [self.templated(p) for p in prompts]
        if not any(flags):  # the common case: no template
            return encode_texts(self.tokenizer, prompts)  # type: ignore[arg-type]
        ids: list[list[int] | None] = [None] * len(prompts)
        for templated in (False, True):
            where = [i for i, flag in enumerate(flags) if flag == templated]
            if where:
                texts = [self.render(prompts[i]) for i in where]
                for i, encoded in zip(
                    where, encode_texts(self.tokenizer, texts, add_special_tokens=not templated)
                ):
                    ids[i] = encoded
        return ids  # type: ignore[return-value]

    def encode_one(self, prompt: Prompt) -> list[int]:
        return self.encode([prompt])[0]
