"""Request bodies the endpoint takes and the OpenAI response bodies it gives back.

Requests: the OpenAI fields the endpoint reads, as pydantic models (the ``openai``
package's own request types are ``TypedDict``s for building a call, not for checking one);
fields it does not use are accepted and ignored, as vLLM's server does. Responses: the
``openai`` package's own models (``Completion``, ``ChatCompletion``,
``ChatCompletionChunk``), plus the extension field ``loomrl`` on every body: per choice the
prompt's and the sampled token ids, the behaviour log-prob and the policy version of every
sampled token (``SampledChoice``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob
from pydantic import BaseModel, ConfigDict, Field

EPISODE_HEADER = "X-Loomrl-Episode"


class _Request(BaseModel):
    # Fields an OpenAI client may send that the endpoint does not use are ignored.
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Request):
    """``POST /v1/completions``: one prompt, as text or as token ids (the exact tokens an
    agent wants to extend, e.g. ``prompt_token_ids + token_ids`` of the last answer)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)


class ChatRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool | None = None


@dataclass
class SampledChoice:
    """One sampled completion: what the extension field reports and an episode records."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: str
    text: str

    def extension(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "prompt_token_ids": self.prompt_ids,
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "versions": [self.version] * len(self.token_ids),
        }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage_of(choices: list[SampledChoice]) -> CompletionUsage:
    prompt = len(choices[0].prompt_ids) if choices else 0
    completion = sum(len(c.token_ids) for c in choices)
    return CompletionUsage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def extension(choices: list[SampledChoice], episode: str | None) -> dict[str, Any]:
    return {"episode_id": episode, "choices": [c.extension(i) for i, c in enumerate(choices)]}


def completion_body(model: str, choices: list[SampledChoice], episode: str | None) -> Completion:
    return Completion(
        id=new_id("cmpl"),
        object="text_completion",
        created=int(time.time()),
        model=model,
        choices=[
            CompletionChoice(index=i, text=c.text, finish_reason=_finish(c.finish_reason))
            for i, c in enumerate(choices)
        ],
        usage=usage_of(choices),
        loomrl=extension(choices, episode),
    )


def _finish(reason: str) -> Literal["stop", "length"]:
    return "length" if reason == "length" else "stop"


def token_logprobs(tokens: list[str], logprobs: list[float]) -> ChoiceLogprobs:
    return ChoiceLogprobs(
        content=[
            ChatCompletionTokenLogprob(token=t, logprob=lp, bytes=list(t.encode()), top_logprobs=[])
            for t, lp in zip(tokens, logprobs)
        ]
    )


def chat_body(
    model: str,
    choices: list[SampledChoice],
    messages: list[ChatCompletionMessage],
    logprobs: list[ChoiceLogprobs | None],
    episode: str | None,
) -> ChatCompletion:
    return ChatCompletion(
        id=new_id("chatcmpl"),
        object="chat.completion",
        created=int(time.time()),
        model=model,
        choices=[
            ChatChoice(
                index=i,
                message=message,
                finish_reason="tool_calls" if message.tool_calls else _finish(c.finish_reason),
                logprobs=lp,
            )
            for i, (c, message, lp) in enumerate(zip(choices, messages, logprobs))
        ],
        usage=usage_of(choices),
        loomrl=extension(choices, episode),
    )


def chat_chunks(body: ChatCompletion, pieces: list[list[str]]) -> list[ChatCompletionChunk]:
    """``body`` as server-sent chunks: per choice its role, then one chunk per sampled
    token's text (``pieces``, the tokens decoded one at a time; a completion with tool calls
    sends them in one chunk), then its finish reason; the last chunk carries the usage and
    the extension field. The HF engine samples a request whole, so the chunks follow the
    sampling, they do not overlap it."""
    base = dict(id=body.id, object="chat.completion.chunk", created=body.created, model=body.model)
    chunks = []
    for choice, texts in zip(body.choices, pieces):
        i, message = choice.index, choice.message
        chunks.append(_chunk(base, i, ChoiceDelta(role="assistant", content="")))
        if message.tool_calls:
            calls = [
                {"index": k, **call.model_dump(exclude_none=True)}
                for k, call in enumerate(message.tool_calls)
            ]
            chunks.append(_chunk(base, i, ChoiceDelta(content=message.content, tool_calls=calls)))
        else:
            chunks += [_chunk(base, i, ChoiceDelta(content=t)) for t in texts if t]
        chunks.append(_chunk(base, i, ChoiceDelta(), finish=choice.finish_reason))
    chunks.append(
        ChatCompletionChunk(**base, choices=[], usage=body.usage, loomrl=body.model_extra["loomrl"])
    )
    return chunks


def _chunk(base: dict, index: int, delta: ChoiceDelta, finish=None) -> ChatCompletionChunk:
    return ChatCompletionChunk(
        **base, choices=[ChunkChoice(index=index, delta=delta, finish_reason=finish)]
    )


def completion_chunks(body: Completion, pieces: list[list[str]]) -> list[Completion]:
    """``body`` as server-sent chunks (the completions API streams ``Completion`` objects):
    one per token's text, a last one per choice with its finish reason, then the usage."""
    chunks = []
    base = dict(id=body.id, object="text_completion", created=body.created, model=body.model)
    for choice, texts in zip(body.choices, pieces):
        chunks += [Completion(**base, choices=[_piece(choice.index, t)]) for t in texts if t]
        last = CompletionChoice(index=choice.index, text="", finish_reason=choice.finish_reason)
        chunks.append(Completion(**base, choices=[last]))
    chunks.append(
        Completion(**base, choices=[], usage=body.usage, loomrl=body.model_extra["loomrl"])
    )
    return chunks


def _piece(index: int, text: str) -> CompletionChoice:
    # A streamed piece has no finish reason yet (null, as OpenAI sends it).
    return CompletionChoice.model_construct(
        index=index, text=text, finish_reason=None, logprobs=None
    )
