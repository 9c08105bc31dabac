"""Chat episodes: the G conversations of one group, driven in lockstep with a generator,
token-exact by construction.

Each turn asks the generator for one completion per live episode, all in one generate call
(seeds ``turn_seed(seed, turn, episode)``), then steps the episodes concurrently. The trained sequence of an episode is its prompt
(the opening messages through the chat template, the tools' schemas in ``tools=``), then
each turn's ids exactly as sampled (``loss_mask`` 1, their behaviour log-probs), and between
two turns the observation's ids (``loss_mask`` 0, log-prob 0.0): the template's rendering
of the conversation with the new messages less its rendering without them
(``ChatRenderer.observation_ids``, which fails by name where a template rewrites earlier
turns). The model's turns are decoded only to be parsed (``task.chat.tool_parser``) and
stepped, never encoded again. With ``per_turn_samples`` each turn is a sample of its own
instead: its prompt the template's rendering of the conversation so far, every turn of an
episode with the episode's reward.

An episode ends when its environment says done (``answered``), or at a limit:
``max_turns``, ``max_episode_tokens`` (prompt, turns and observations; the next turn may
only sample what is left), ``max_new_tokens`` (a turn cut mid-way). An episode a limit ends
is scored by ``reward`` on the conversation up to the model's last turn. An environment that
raises fails only its own rollout. Each rollout's ``completion`` is the conversation after
the opening messages as text (``[assistant] ...``, ``[tool name] ...``), for samples.jsonl.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from loomrl.envs.chat import AssistantMessage, ChatEnvironment, ChatStepResult
from loomrl.envs.chat_render import ChatRenderer
from loomrl.envs.episode import Generate, turn_seed
from loomrl.envs.episode_stats import EpisodeStats
from loomrl.envs.tool_parsers import Parser
from loomrl.envs.tools import ToolLog, ToolRunner
from loomrl.scoring.calls import RewardFailure, check_value  # a reward function's bounds
from loomrl.types import (
    GenerationRequest,
    Rollout,
    SamplingParams,
    sampled_versions,
    versions_column,
)

CUT_MARKER = "\n[... cut: {} more tokens]"


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


@dataclass
class ChatLimits:
    """What bounds one episode (``task.chat`` and ``task.max_turns``)."""

    parser: Parser
    max_turns: int
    tool_timeout_s: float = 10.0
    max_tool_result_tokens: int = 512
    max_episode_tokens: int | None = None
    per_turn_samples: bool = False


@dataclass
class _Chat:
    env: ChatEnvironment
    runner: ToolRunner | None = None
    renderer: ChatRenderer | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    rendered: list[int] = field(default_factory=list)  # the template's ids so far, reopened
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    # per turn (per_turn_samples): context, ids, log-probs, the version behind each id, text
    turns: list[tuple[list[int], list[int], list[float], list[int], str]] = field(
        default_factory=list
    )
    token_versions: list[int] = field(default_factory=list)  # of ``ids`` (observations: the last)
    lines: list[str] = field(default_factory=list)
    reward: float = 0.0
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    end: str | None = None  # why it ended; None while it runs
    error: str | None = None

    def context(self, per_turn: bool) -> list[int]:
        """What the next turn is sampled after."""
        return self.rendered if per_turn else self.prompt_ids + self.ids

    def fail(self, error: str) -> None:
        self.error, self.end = error, "error"

    def num_tokens(self, per_turn: bool) -> int:
        """The episode's tokens: prompt, turns and observations (per turn: the last
        turn's context and its sampled ids)."""
        if per_turn and self.turns:
            return len(self.turns[-1][0]) + len(self.turns[-1][1])
        return len(self.prompt_ids) + len(self.ids)

    def tool_log(self) -> ToolLog:
        return self.runner.log if self.runner is not None else ToolLog()


def transcript(messages: list[dict[str, Any]]) -> list[str]:
    """Messages as text lines: ``[role] content``, a tool's answer as ``[tool name] ...``."""
    lines = []
    for m in messages:
        role = f"tool {m.get('name', '')}".strip() if m.get("role") == "tool" else m.get("role")
        lines.append(f"[{role}] {m.get('content', '')}")
    return lines


def _cutter(tokenizer: Any, max_tokens: int) -> Callable[[str], tuple[str, bool]]:
    def cut(text: str) -> tuple[str, bool]:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) <= max_tokens:
            return text, False
        kept = tokenizer.decode(ids[:max_tokens], skip_special_tokens=True)
        return kept + CUT_MARKER.format(len(ids) - max_tokens), True

    return cut


async def _open(ep: _Chat, row: dict, tokenizer: Any, limits: ChatLimits, model: str) -> None:
    """Reset the environment and render its opening messages (a failure fails the episode)."""
    try:
        ep.runner = ToolRunner(
            list(ep.env.tools),
            limits.tool_timeout_s,
            _cutter(tokenizer, limits.max_tool_result_tokens),
        )
        ep.env.begin(dict(row), ep.runner)
        opening = await _maybe_await(ep.env.reset(dict(row)))
        if not (isinstance(opening, list) and all(isinstance(m, dict) for m in opening)):
            raise TypeError(f"reset returned {type(opening).__name__}, expected a list of messages")
        ep.messages = ep.env.messages
        ep.messages.extend(opening)
        ep.renderer = ChatRenderer(tokenizer, ep.runner.schemas, model)
        ep.prompt_ids = ep.rendered = ep.renderer.ids(ep.messages, generation_prompt=True)
    except Exception as err:  # noqa: BLE001 - user environment code (and its tools' schemas)
        ep.fail(f"reset raised {type(err).__name__}: {err}")


def _requests(
    episodes: list[_Chat], live: list[int], sampling: SamplingParams, seed: int, turn: int, limits
) -> list[GenerationRequest]:
    """One request per live episode, each allowed what its token budget leaves."""
    requests = []
    for i in live:
        context = episodes[i].context(limits.per_turn_samples)
        params = sampling
        if limits.max_episode_tokens is not None:
            room = limits.max_episode_tokens - len(context)
            params = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room))
        requests.append(GenerationRequest(context, 1, params, turn_seed(seed, turn, i)))
    return requests


async def _score_cut(ep: _Chat, reason: str) -> None:
    """End the episode at a limit, scored on the conversation up to the model's last turn."""
    turns = [i for i, m in enumerate(ep.messages) if m.get("role") == "assistant"]
    if turns:
        upto = turns[-1] + 1
        await _add_reward(ep, lambda: ep.env.reward(ep.messages[:upto], ep.env.row))
    if ep.error is None:
        ep.end = reason


async def _add_reward(ep: _Chat, get: Callable[[], Any]) -> None:
    try:
        value = await _maybe_await(get())
        # a finite float32 number, as a reward function's (a bigint or 1e39 fails the episode)
        ep.reward = check_value(ep.reward + check_value(value))
    except RewardFailure as failure:
        ep.fail(f"environment reward: {failure}")
    except Exception as err:  # noqa: BLE001 - user environment code
        ep.fail(f"reward raised {type(err).__name__}: {err}")


async def _step(ep: _Chat, message: AssistantMessage) -> ChatStepResult | None:
    try:
        result = await _maybe_await(ep.env.step(message))
    except Exception as err:  # noqa: BLE001 - user environment code
        ep.fail(f"step raised {type(err).__name__}: {err}")
        return None
    if not isinstance(result, ChatStepResult):
        ep.fail(f"step returned {type(result).__name__}, expected ChatStepResult")
        return None
    await _add_reward(ep, lambda: result.reward)
    return None if ep.error is not None else result


def _record_turn(ep: _Chat, result, context: list[int], per_turn: bool, decode) -> str:
    """The sampled ids as they came (trained), and their text."""
    ids, logprobs = list(result.token_ids[0]), list(result.logprobs[0])
    versions = sampled_versions(result)
    ep.versions.append(result.version)
    ep.finish_reason = result.finish_reasons[0]
    text = decode(ids)
    if per_turn:
        ep.turns.append((context, ids, logprobs, versions, text))
    else:
        ep.ids += ids
        ep.logprobs += logprobs
        ep.mask += [1] * len(ids)
        ep.token_versions += versions
    ep.lines.append(f"[assistant] {text}")
    return text


async def _take_turn(ep: _Chat, result, context, *, decode, limits: ChatLimits, last: bool):
    """Record the model's turn, step the environment with it and, when the episode goes on,
    append the observation (masked out of the loss)."""
    text = _record_turn(ep, result, context, limits.per_turn_samples, decode)
    content, calls, errors = limits.parser(text)
    message = AssistantMessage(content, calls, errors)
    ep.messages.append(message.as_message())
    if ep.finish_reason != "stop":
        return await _score_cut(ep, "max_new_tokens")
    step = await _step(ep, message)
    if step is None:
        return None
    if step.done:
        ep.end = "answered"
        return None
    if last:
        return await _score_cut(ep, "max_turns")
    sampled = list(result.token_ids[0])
    if limits.per_turn_samples:
        obs, rendered = [], ep.renderer.ids(ep.messages + step.messages, generation_prompt=True)
    else:
        obs, rendered = ep.renderer.observation_ids(
            ep.rendered, ep.messages, step.messages, sampled
        )
    size = len(rendered) if limits.per_turn_samples else len(ep.prompt_ids) + len(ep.ids) + len(obs)
    if limits.max_episode_tokens is not None and size >= limits.max_episode_tokens:
        return await _score_cut(ep, "max_episode_tokens")
    ep.ids += obs
    ep.logprobs += [0.0] * len(obs)
    ep.mask += [0] * len(obs)
    ep.token_versions += (ep.token_versions[-1:] or ep.versions[-1:]) * len(obs)
    ep.rendered = rendered
    ep.messages.extend(step.messages)
    ep.lines += transcript(step.messages)
    return None


async def run_chat_episodes(
    envs: list[ChatEnvironment],
    row: dict,
    prompt_index: int,
    *,
    generate: Generate,
    tokenizer: Any,
    sampling: SamplingParams,
    limits: ChatLimits,
    seed: int,
    stats: EpisodeStats | None = None,
    model: str = "the model",
) -> list[Rollout]:
    """Run one chat episode per environment in lockstep; its rollouts (one per episode, or
    one per turn with ``per_turn_samples``). A template that rewrites history raises
    ``TemplateDriftError`` here."""
    t0 = time.perf_counter()
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    episodes = [_Chat(env=env) for env in envs]
    for ep in episodes:
        await _open(ep, row, tokenizer, limits, model)
    for turn in range(limits.max_turns):
        live = [i for i, ep in enumerate(episodes) if ep.end is None]
        for i in live:
            room = limits.max_episode_tokens
            if room is not None and len(episodes[i].context(limits.per_turn_samples)) >= room:
                await _score_cut(episodes[i], "max_episode_tokens")
        live = [i for i in live if episodes[i].end is None]
        if not live:
            break
        requests = _requests(episodes, live, sampling, seed, turn, limits)
        results = await generate(requests)
        # the episodes' steps (their tool calls) run concurrently
        last = turn + 1 == limits.max_turns
        await asyncio.gather(
            *(
                _take_turn(
                    episodes[i], result, req.prompt_ids, decode=decode, limits=limits, last=last
                )
                for i, req, result in zip(live, requests, results)
            )
        )
    elapsed = time.perf_counter() - t0
    rollouts = []
    for ep in episodes:
        if stats is not None:
            tokens = ep.num_tokens(limits.per_turn_samples)
            stats.add(len(ep.versions), tokens, ep.tool_log(), ep.end or "error")
        rollouts += _rollouts_of(ep, row, prompt_index, elapsed, limits.per_turn_samples)
    return rollouts


def _rollouts_of(
    ep: _Chat, row: dict, prompt_index: int, elapsed_s: float, per_turn: bool
) -> list[Rollout]:
    """The episode's rollout (its whole conversation), or with ``per_turn`` one per turn,
    each with the episode's reward; a failed episode gives one failed rollout."""
    opening = "\n".join(transcript(ep.messages[: _num_opening(ep)]))
    common = dict(
        prompt_index=prompt_index,
        prompt=opening,
        row=dict(row),
        reward=ep.reward,
        finish_reason=ep.finish_reason,
        timings={"episode_s": elapsed_s},
    )
    if per_turn and ep.error is None and ep.turns:
        return [
            Rollout(
                prompt_ids=context,
                completion_ids=ids,
                behaviour_logprobs=logprobs,
                loss_mask=[1] * len(ids),
                version=min(versions, default=version),
                completion=text,
                token_versions=versions_column(versions, min(versions, default=version)),
                **common,
            )
            for (context, ids, logprobs, versions, text), version in zip(ep.turns, ep.versions)
        ]
    rollout = Rollout(
        prompt_ids=ep.prompt_ids,
        completion_ids=ep.ids,
        behaviour_logprobs=ep.logprobs,
        loss_mask=ep.mask,
        version=min(ep.versions) if ep.versions else 0,
        completion="\n".join(ep.lines),
        num_turns=len(ep.versions),
        token_versions=versions_column(ep.token_versions, min(ep.versions, default=0)),
        **common,
    )
    if ep.error is not None:
        rollout.status, rollout.error, rollout.reward = "failed", ep.error, None
        rollout.failure = "environment"
    return [rollout]


def _num_opening(ep: _Chat) -> int:
    """How many messages opened the episode (those before the model's first turn)."""
    roles = [m.get("role") for m in ep.messages]
    return roles.index("assistant") if "assistant" in roles else len(roles)
