"""Multi-turn episodes: the G environments of one group, driven in lockstep with a generator.

Turn 1 asks the generator for one completion per live episode (one request each,
``num_samples=1``, seeds derived from the job seed, the turn and the episode), and hands
each decoded completion to its environment's ``step``. An episode that is not done gets
the observation appended (encoded, ``loss_mask`` 0, behaviour log-prob 0.0) and then the
next turn's tokens (``loss_mask`` 1, with their log-probs); the next prompt is the
original prompt ids plus everything appended so far. The reward is the sum of the step
rewards, the version the minimum over the turns. An environment that raises fails only
its own rollout (``status="failed"``, the error kept), never the others.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from loomrl.envs.base import Environment, StepResult
from loomrl.scoring.calls import RewardFailure, check_value  # a reward function's bounds
from loomrl.types import (
    GenerationRequest,
    GenerationResult,
    Rollout,
    SamplingParams,
    sampled_versions,
    versions_column,
)

logger = logging.getLogger(__name__)

Generate = Callable[[list[GenerationRequest]], Awaitable[list[GenerationResult]]]


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def turn_seed(seed: int, turn: int, episode: int) -> int:
    """Sampling seed of one episode's turn: distinct per (seed, turn, episode)."""
    return (seed * 1_000_003 + turn) * 1_009 + episode


@dataclass
class _Episode:
    env: Environment
    prompt_ids: list[int] = field(default_factory=list)
    prompt: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    reward: float = 0.0
    versions: list[int] = field(default_factory=list)
    num_turns: int = 0
    finish_reason: str = "stop"
    done: bool = False
    error: str | None = None

    # the version that sampled each of ``ids`` (an observation: its turn's newest)
    token_versions: list[int] = field(default_factory=list)

    def append(
        self,
        ids: list[int],
        logprobs: list[float],
        trained: bool,
        versions: list[int] | None = None,
    ) -> None:
        self.ids += ids
        self.logprobs += logprobs if trained else [0.0] * len(ids)
        self.mask += [1 if trained else 0] * len(ids)
        last = self.token_versions[-1] if self.token_versions else 0
        self.token_versions += versions if versions is not None else [last] * len(ids)


def _strip_prefix(ids: list[int], prefix: list[int]) -> list[int]:
    return ids[len(prefix) :] if prefix and ids[: len(prefix)] == prefix else ids


async def _reset_all(episodes: list[_Episode], row: dict, encode: Callable) -> None:
    for ep in episodes:
        try:
            ep.prompt = str(await _maybe_await(ep.env.reset(dict(row))))
            ep.prompt_ids = list(encode(ep.prompt))
        except Exception as err:  # noqa: BLE001 - user environment code
            ep.error, ep.done = f"reset raised {type(err).__name__}: {err}", True


async def _step(ep: _Episode, completion: str) -> StepResult | None:
    try:
        result = await _maybe_await(ep.env.step(completion))
    except Exception as err:  # noqa: BLE001 - user environment code
        ep.error, ep.done = f"step raised {type(err).__name__}: {err}", True
        return None
    if not isinstance(result, StepResult):
        ep.error, ep.done = f"step returned {type(result).__name__}, expected StepResult", True
        return None
    return result


def _turn_requests(
    episodes: list[_Episode], live: list[int], sampling: SamplingParams, seed: int, turn: int
) -> list[GenerationRequest]:
    """One request per live episode: its conversation so far, seeded by (seed, turn, index)."""
    return [
        GenerationRequest(
            prompt_ids=episodes[i].prompt_ids + episodes[i].ids,
            num_samples=1,
            sampling=sampling,
            seed=turn_seed(seed, turn, i),
        )
        for i in live
    ]


async def _take_turn(
    ep: _Episode,
    result,
    *,
    decode: Callable,
    encode: Callable,
    special_prefix: list[int],
    more_turns: bool,
) -> None:
    """Record the model's turn, step the environment with it, and append its observation
    (masked out of the loss) when the episode goes on."""
    ids, logprobs = result.token_ids[0], result.logprobs[0]
    ep.append(list(ids), list(logprobs), trained=True, versions=sampled_versions(result))
    ep.versions.append(result.version)
    ep.num_turns += 1
    ep.finish_reason = result.finish_reasons[0]
    text = decode(list(ids))
    ep.texts.append(text)
    step = await _step(ep, text)
    if step is None:
        return
    try:  # a finite float32 number, as a reward function's (a bigint or 1e39 fails the episode)
        ep.reward = check_value(ep.reward + check_value(step.reward))
    except RewardFailure as failure:
        ep.error, ep.done = f"environment step: {failure}", True
        return
    ep.done = bool(step.done)
    if not ep.done and more_turns and step.observation:
        obs_ids = _strip_prefix(list(encode(step.observation)), special_prefix)
        ep.append(obs_ids, [], trained=False)
        ep.texts.append(step.observation)


async def run_group_episodes(
    envs: list[Environment],
    row: dict,
    prompt_index: int,
    *,
    generate: Generate,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    sampling: SamplingParams,
    max_turns: int,
    seed: int,
) -> list[Rollout]:
    """Run one episode per environment in lockstep; one ``Rollout`` per environment."""
    t0 = time.perf_counter()
    episodes = [_Episode(env=env) for env in envs]
    await _reset_all(episodes, row, encode)
    special_prefix = list(encode(""))  # e.g. BOS: kept on prompts, stripped from observations
    for turn in range(max_turns):
        live = [i for i, ep in enumerate(episodes) if not ep.done]
        if not live:
            break
        results = await generate(_turn_requests(episodes, live, sampling, seed, turn))
        for i, result in zip(live, results):
            await _take_turn(
                episodes[i],
                result,
                decode=decode,
                encode=encode,
                special_prefix=special_prefix,
                more_turns=turn + 1 < max_turns,
            )
    elapsed = time.perf_counter() - t0
    return [_to_rollout(ep, row, prompt_index, elapsed) for ep in episodes]


def _to_rollout(ep: _Episode, row: dict, prompt_index: int, elapsed_s: float) -> Rollout:
    version = min(ep.versions) if ep.versions else 0
    rollout = Rollout(
        prompt_index=prompt_index,
        prompt_ids=ep.prompt_ids,
        completion_ids=ep.ids,
        behaviour_logprobs=ep.logprobs,
        loss_mask=ep.mask,
        version=version,
        prompt=ep.prompt,
        completion="".join(ep.texts),
        row=dict(row),
        reward=ep.reward,
        finish_reason=ep.finish_reason,
        num_turns=ep.num_turns,
        timings={"episode_s": elapsed_s},
        token_versions=versions_column(ep.token_versions, version),
    )
    if ep.error is not None:
        rollout.status, rollout.error, rollout.reward = "failed", ep.error, None
        rollout.failure = "environment"
        logger.debug("episode of prompt %d failed: %s", prompt_index, ep.error)
    return rollout
