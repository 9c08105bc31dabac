"""Prompts into token ids: plain text as the tokenizer encodes it, or messages through the
tokenizer's chat template.

A templated prompt is rendered to text with the generation prompt (the assistant turn's
opening) and tokenized with no special tokens added: the template writes its own BOS, and
the tokenizer's own would make two (``[bos, bos, ...]``, the model's first position out of
its training distribution). The reward still gets the prompt as the dataset holds it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from loomrl.config import DataConfig
from loomrl.data import DatasetError
from loomrl.prompt_fit import encode_texts

# The longest one prompt's chat template may render for. jinja's sandbox caps one range()
# but not nested loops: a template from a handed model folder can run for hours.
TEMPLATE_BUDGET_S = 10.0


class TemplateTimeout(Exception):
    """Raised inside a template's frames when its render ran past its budget."""


def render_within(render, budget_s: float) -> str:
    """``render()``, stopped with ``TemplateTimeout`` once it has run ``budget_s`` seconds.

    Every line a compiled jinja template (code named ``<template>``) runs checks the clock:
    a trace on this thread for the render alone, frames of other code are not traced line
    by line. Where a tracer is already installed (a debugger, coverage) it is left alone
    and the render is not bounded."""
    if sys.gettrace() is not None:
        return render()
    deadline = time.monotonic() + budget_s

    def on_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateTimeout
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename == "<template>" else None

    sys.settrace(on_call)
    try:
        return render()
    finally:
        sys.settrace(None)


# a text, or {role, content} messages (TRL's conversational format)
Prompt = str | list[dict[str, str]]


class PromptEncoder:
    """Renders and encodes the dataset's prompts as ``data.chat_template`` and
    ``data.system_prompt`` say."""

    def __init__(self, tokenizer: Any, data: DataConfig, model: str = "the model") -> None:
        self.tokenizer, self.data = tokenizer, data
        self.model = model  # for messages: the model path
        self.template_budget_s = TEMPLATE_BUDGET_S

    def templated(self, prompt: Prompt) -> bool:
        """Whether ``prompt`` goes through the chat template."""
        if isinstance(prompt, list) and self.data.chat_template is False:
            raise DatasetError(
                "a prompt is a list of messages but data.chat_template=false; set it to 'auto' or true"
            )
        return self.data.templated(prompt)

    def messages(self, prompt: Prompt) -> list[dict[str, str]]:
        """The prompt as messages, with the system prompt first (unless it has its own)."""
        return self.data.messages(prompt)

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
        # lazy: jinja2 (transformers' template engine) loads only for a chat template
        from jinja2 import TemplateError

        try:
            return render_within(
                lambda: self.tokenizer.apply_chat_template(
                    self.messages(prompt), tokenize=False, add_generation_prompt=True
                ),
                self.template_budget_s,
            )
        except TemplateTimeout:
            raise DatasetError(
                f"{self._template_name()} rendered one prompt for more than "
                f"{self.template_budget_s:g} s and was stopped (loops inside loops?); fix or "
                "replace the template"
            ) from None
        except TemplateError as err:
            raise DatasetError(
                f"{self._template_name()} could not render a prompt: {type(err).__name__}: {err} "
                "(jinja's sandbox refuses templates that reach past plain data)"
            ) from None

    def _template_name(self) -> str:
        """Where the model's chat template comes from, for errors."""
        folder = Path(self.model)
        for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
            if (folder / name).is_file():
                return f"the chat template of {self.model} ({folder / name})"
        return f"the chat template of {self.model}"

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
