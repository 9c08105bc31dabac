"""A conversation's tokens through the tokenizer's chat template, and the tokens an
observation adds, as the difference of two renderings.

The model's own turns are never rendered again: the trained sequence is the prompt's ids,
then each turn's sampled ids as the engine returned them, with the observation's ids in
between. Those are what the template writes after the assistant turn: its rendering of the
conversation with the new messages (and the next turn's opening) less its rendering without
them. That holds only when the template renders a conversation's earlier turns the same
whatever follows them; ``observation_ids`` checks it each time, on the tokens, and raises
``TemplateDriftError`` naming where the two renderings part (a template that drops earlier
turns' reasoning, or writes the last turn differently). ``task.chat.per_turn_samples`` is
the fallback for such a template.
"""

from __future__ import annotations

from typing import Any

from loomrl.chat import TEMPLATE_BUDGET_S, TemplateTimeout, render_within


class TemplateDriftError(RuntimeError):
    """The chat template renders earlier turns differently once later messages follow: an
    observation's tokens are not a difference of two renderings, and training on them would
    train on tokens the model never saw."""


class ChatRenderer:
    """Renders messages (and the tools' schemas) with ``tokenizer``'s chat template into ids
    (no special tokens added: the template writes its own BOS)."""

    def __init__(self, tokenizer: Any, schemas: list[dict[str, Any]], model: str = "the model"):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{model}'s tokenizer has no chat template, which chat environments render "
                "their turns with: use an instruct model's folder"
            )
        self.tokenizer, self.schemas, self.model = tokenizer, schemas or None, model

    def ids(self, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        try:
            text = render_within(
                lambda: self.tokenizer.apply_chat_template(
                    messages,
                    tools=self.schemas,
                    tokenize=False,
                    add_generation_prompt=generation_prompt,
                ),
                TEMPLATE_BUDGET_S,
            )
        except TemplateTimeout:
            raise RuntimeError(
                f"{self.model}'s chat template rendered one conversation for more than "
                f"{TEMPLATE_BUDGET_S:g} s and was stopped"
            ) from None
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def observation_ids(
        self,
        opened: list[int],
        history: list[dict[str, Any]],
        new: list[dict[str, Any]],
        sampled: list[int],
    ) -> tuple[list[int], list[int]]:
        """The ids to append after a turn's ``sampled`` ids so that the next turn opens as
        the template opens it, and the template's ids of the whole conversation so far.

        ``opened``: the ids of the conversation before the turn, with its generation prompt
        (what the previous call returned second); ``history``: the conversation with the
        assistant's message last; ``new``: the messages that follow it. The ids are the
        template's tail of the assistant turn after the token the model stopped on (a
        newline after the end-of-turn token), then the new messages and the next turn's
        opening."""
        closed = self.ids(history, generation_prompt=False)
        self._check_prefix(opened, closed, "the assistant's turn", history)
        reopened = self.ids(history + new, generation_prompt=True)
        self._check_prefix(closed, reopened, f"{len(new)} new message(s)", history + new)
        turn = closed[len(opened) :]
        tail: list[int] = []
        if sampled and sampled[-1] in turn:
            last = len(turn) - 1 - turn[::-1].index(sampled[-1])
            tail = turn[last + 1 :]
        return tail + reopened[len(closed) :], reopened

    def _check_prefix(
        self, before: list[int], after: list[int], added: str, messages: list[dict[str, Any]]
    ) -> None:
        if after[: len(before)] == before:
            return
        at = next(
            (i for i, (a, b) in enumerate(zip(before, after)) if a != b),
            min(len(before), len(after)),
        )
        decode = self.tokenizer.decode
        raise TemplateDriftError(
            f"{self.model}'s chat template rewrites earlier turns: with {added} after "
            f"{len(messages)} messages its rendering parts from the one before at token {at} "
            f"({decode(before[at : at + 12])!r} became {decode(after[at : at + 12])!r}), so "
            "an observation is not a difference of two renderings. Set "
            "task.chat.per_turn_samples = true to train each turn as its own sample (with the "
            "episode's reward), or use a template that keeps history"
        )
