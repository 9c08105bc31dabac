"""The policy as the endpoint serves it: request bodies into ``GenerationRequest``s (text
through the tokenizer, messages through its chat template), results into sampled choices
(cut at the request's stop strings) and chat messages (with tool calls when a parser is set).

A tokenizer without a chat template (the tiny test models') renders messages with
``FALLBACK_TEMPLATE``: one ``role: content`` line each, then ``assistant:``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import ChoiceLogprobs

from loomrl.generation.base import cut_at_stop
from loomrl.serve.batcher import Batcher
from loomrl.serve.protocol import ChatRequest, CompletionRequest, SampledChoice, token_logprobs
from loomrl.types import GenerationRequest, GenerationResult, SamplingParams

FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# text -> (content, tool calls as OpenAI dicts, parse errors)
ToolParser = Callable[[str], tuple[str | None, list[dict[str, Any]], list[str]]]


def load_tool_parser(name: str | None) -> ToolParser | None:
    """``serve.tool_parser``: 'module:function', or a name of ``loomrl.envs.tool_parsers``'
    registry (``hermes``, ``llama3_json``, ``mistral``: the parsers chat episodes use)."""
    if name is None:
        return None
    from loomrl.scoring.calls import load_object

    if ":" in name:
        return load_object(name)
    from loomrl.envs.tool_parsers import get_parser

    try:
        parse = get_parser(name)
    except ValueError as err:
        raise ValueError(f"serve.tool_parser={name!r}: {err}") from None

    def parse_as_dicts(text: str) -> tuple[str | None, list[dict[str, Any]], list[str]]:
        content, calls, errors = parse(text)
        return content, [call.as_message_part() for call in calls], errors

    return parse_as_dicts


class RequestError(ValueError):
    """A request the policy cannot serve as asked (answered 400)."""


class ServedPolicy:
    """Turns OpenAI requests into generate calls through one ``Batcher`` (module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        batcher: Batcher,
        *,
        default_max_tokens: int,
        max_tokens: int,
        seed: int = 0,
        tool_parser: ToolParser | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.chat_template = chat_template
        self.tokenizer, self.batcher, self.tool_parser = tokenizer, batcher, tool_parser
        self.default_max_tokens, self.max_tokens = default_max_tokens, max_tokens
        self._seeds = itertools.count(seed * 1_000_003 + 1)

    def _sampling(self, req: CompletionRequest | ChatRequest, asked: int | None) -> SamplingParams:
        max_new = asked or self.default_max_tokens
        if max_new > self.max_tokens:
            raise RequestError(f"max_tokens={max_new} is over this endpoint's {self.max_tokens}")
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        if temperature == 0:
            return SamplingParams(1.0, 1.0, max_new, greedy=True)
        return SamplingParams(temperature, top_p, max_new)

    def encode_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        if prompt and all(isinstance(t, int) for t in prompt):
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in prompt):
                raise RequestError(f"a prompt token id is outside the vocabulary (0..{vocab - 1})")
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:
            return self.encode_prompt(prompt[0])
        raise RequestError(
            "prompt: give one text or one list of token ids (batched prompts: one request each)"
        )

    def render_chat(self, req: ChatRequest) -> list[int]:
        template = self.chat_template or self.tokenizer.chat_template or FALLBACK_TEMPLATE
        messages = [_plain_message(m) for m in req.messages]
        text = self.tokenizer.apply_chat_template(
            messages,
            tools=req.tools,
            chat_template=template,
            add_generation_prompt=True,
            tokenize=False,
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def sample(self, prompt_ids: list[int], req, asked: int | None) -> list[SampledChoice]:
        """``req.n`` completions of ``prompt_ids``, cut at the request's stop strings."""
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        seed = req.seed if req.seed is not None else next(self._seeds)
        request = GenerationRequest(prompt_ids, req.n, self._sampling(req, asked), seed)
        result: GenerationResult = await self.batcher.submit(request)
        ids = [list(t) for t in result.token_ids]
        logprobs = [list(lp) for lp in result.logprobs]
        finish = list(result.finish_reasons)
        texts = (
            list(result.texts)
            if result.has_texts
            else self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        )
        if req.stops():
            cut_at_stop(self.tokenizer, req.stops(), ids, logprobs, finish, texts)
        return [
            SampledChoice(prompt_ids, i, lp, result.version, f, t)
            for i, lp, f, t in zip(ids, logprobs, finish, texts)
        ]

    def message_of(self, choice: SampledChoice) -> ChatCompletionMessage:
        """The assistant message of a sampled choice: tool calls parsed out of its text
        when a parser is set (a text that does not parse stays content)."""
        if self.tool_parser is None:
            return ChatCompletionMessage(role="assistant", content=choice.text)
        content, calls, _errors = self.tool_parser(choice.text)
        return ChatCompletionMessage(
            role="assistant",
            content=content,
            tool_calls=[_tool_call(c, k) for k, c in enumerate(calls)] or None,
        )

    def logprobs_of(self, choice: SampledChoice) -> ChoiceLogprobs:
        pieces = self.pieces(choice)
        return token_logprobs(pieces, choice.logprobs)

    def pieces(self, choice: SampledChoice) -> list[str]:
        """Each sampled token's text (for streaming and chat log-probs)."""
        return [self.tokenizer.decode([t], skip_special_tokens=True) for t in choice.token_ids]


def _plain_message(message: dict[str, Any]) -> dict[str, Any]:
    # Content given as parts ([{type: text, text}]) is joined into one text for the template.
    content = message.get("content")
    if isinstance(content, list):
        message = {**message, "content": "".join(p.get("text", "") for p in content)}
    return message


def _tool_call(call: dict[str, Any], index: int) -> dict[str, Any]:
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    return {
        "id": call.get("id") or f"call_{index}",
        "type": "function",
        "function": {
            "name": function.get("name", ""),
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        },
    }
