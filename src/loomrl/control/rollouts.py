"""Requests in, groups out: the plumbing between the generation loop and a generator.

``Rollouts.generate_groups(generator, picks)`` turns a request's prompt picks into
``GenerationRequest``s, asks the generator for them (applying the newest weights first, in
the same call, when it is behind) and gives back the groups, one per prompt. What the
results report (weight-apply pauses, the generators' ``weight_sync/*`` and engine totals)
is read where the call ended, off the controller's loop, along with the groups themselves
and what a scorer executor takes for them (``Endpoint.call``'s ``then``): the loop then only
awaits one finished answer per request.
"""

from __future__ import annotations

import operator
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from loomrl.config import JobConfig
from loomrl.control.prompts import PromptCache
from loomrl.envs.chat_episode import ChatLimits
from loomrl.envs.episode import run_group_episodes
from loomrl.envs.episode_stats import EpisodeStats
from loomrl.envs.tool_parsers import get_parser
from loomrl.runtime.threads import release_later
from loomrl.scoring.base import group_payload
from loomrl.types import GenerationRequest, GenerationResult, Group, SamplingParams

# (read per result with map: a request has up to a few hundred results)
_weight_apply_s, _weight_metrics, _engine_metrics, _newest_version, _prompt_ids, _has_texts = (
    operator.attrgetter(a)
    for a in (
        "weight_apply_s",
        "weight_metrics",
        "engine_metrics",
        "newest_version",
        "prompt_ids",
        "has_texts",
    )
)


def chat_limits(cfg: JobConfig, max_prompt_tokens: int | None) -> ChatLimits:
    """``task.chat``'s limits; an episode's tokens default to the model's context (the
    prompt budget and ``max_new_tokens``, when the model says its context)."""
    chat = cfg.task.chat
    context = (
        max_prompt_tokens + cfg.generation.max_new_tokens if max_prompt_tokens is not None else None
    )
    return ChatLimits(
        parser=get_parser(chat.tool_parser),
        max_turns=cfg.task.max_turns,
        tool_timeout_s=chat.tool_timeout_s,
        max_tool_result_tokens=chat.max_tool_result_tokens,
        max_episode_tokens=chat.max_episode_tokens or context,
        per_turn_samples=chat.per_turn_samples,
    )


def sample_seed(job_seed: int, epoch: int, index: int) -> int:
    return (job_seed * 1_000_003 + epoch) * 10_000_019 + index


@dataclass
class Versions:
    """The trainer's policy version, the newest one published to the generators, and how
    far behind it a training request may run."""

    trained: int
    published: int
    max_staleness: int

    def oldest_for_training(self) -> int:
        """The oldest weights a new training request may run on: the latest published
        version, less what max_staleness allows (so in synchronous mode exactly it)."""
        return max(0, self.published - self.max_staleness)


class GeneratorReports:
    """What generate calls reported, kept for the step record and the next call: weight
    pauses since the last step, the generators' latest ``weight_sync/*``, each engine's
    totals, and the version each generator last said it holds."""

    def __init__(self) -> None:
        self.apply_s = 0.0  # generator pauses for weight updates since the last step
        self.weight_metrics: dict[str, float] = {}
        self.engine_metrics: dict[int, dict[str, float]] = {}  # id(generator) -> its totals
        self.held: dict[int, int] = {}  # id(generator) -> the version it last reported holding

    def add(self, key: int, apply_s: float, weight, engine, version: int) -> None:
        self.apply_s += apply_s  # generate's own catch-up, if any
        if weight is not None:
            self.weight_metrics = weight
        if engine is not None:
            self.engine_metrics[key] = engine
        if version > self.held.get(key, -1):
            self.held[key] = version

    def forget(self, key: int) -> None:
        """A restarted generator holds only the model's own weights."""
        self.held.pop(key, None)

    def take_apply_s(self) -> float:
        """The pauses since the last call (the step's ``weight_sync/apply_s``)."""
        apply_s, self.apply_s = self.apply_s, 0.0
        return apply_s


def _read_reports(
    then: Callable[[list[GenerationResult]], Any] | None, results: list[GenerationResult]
) -> tuple:
    """Off the loop, where a generate call ended: what its results report (an engine puts
    it on one of them), and ``then(results)`` (the results themselves without a ``then``)."""
    weight = [m for m in map(_weight_metrics, results) if m]
    engine = [m for m in map(_engine_metrics, results) if m]
    return (
        sum(map(_weight_apply_s, results)),
        weight[-1] if weight else None,
        engine[-1] if engine else None,
        max(map(_newest_version, results), default=-1),  # what the generator now holds
        results if then is None else then(results),
    )


def _groups_of(picks, requests, rows, prompt_key, results: list[GenerationResult]) -> tuple:
    """Off the loop, where a training request's generate call ended: the results, their
    groups, how many completions they hold and what a scorer executor takes for them. When
    an engine left texts to decode, the groups are left to the loop (the tokenizer is the
    loop's): groups and payload are then None."""
    count = sum(map(len, results))
    if not all(map(_has_texts, results)):
        return results, None, count, None
    groups = Group.from_results(
        picks, list(map(_prompt_ids, requests)), rows, prompt_key, results, None
    )
    return results, groups, count, group_payload(groups)


class Rollouts:
    """Generate calls for the controller's loops (module docstring)."""

    def __init__(
        self,
        cfg: JobConfig,
        prompts: PromptCache,
        versions: Versions,
        on_device: Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[Any]],
    ) -> None:
        self.prompts, self.versions, self.on_device = prompts, versions, on_device
        self.sampling = SamplingParams(
            temperature=cfg.generation.temperature,
            top_p=cfg.generation.top_p,
            max_new_tokens=cfg.generation.max_new_tokens,
        )
        self.group_size, self.seed = cfg.algorithm.group_size, cfg.seed
        self.reports = GeneratorReports()
        self.model = cfg.model.path
        self.episode_stats = EpisodeStats()  # chat episodes' episode/* metrics
        self.chat_limits = chat_limits(cfg, prompts.max_prompt_tokens)

    def generate(self, generator, requests: list[GenerationRequest], then=None) -> Awaitable[Any]:
        """Apply the newest weights the requests may use, then generate on them: one
        device phase (one lease when the job shares its devices, so no other job's phase
        and no swap comes between applying the weights and using them). To await: the
        results, or ``then(results)``, run off the loop where the call ended."""
        return self.on_device(
            "generate", lambda: self._apply_and_generate(generator, requests, then)
        )

    async def _apply_and_generate(self, generator, requests, then) -> Any:
        # A generator behind the newest published version applies it first, in the same
        # call (one round trip); one that holds it is not asked to look.
        key = id(generator)
        behind = self.reports.held.get(key, -1) < self.versions.published
        apply_s, weight, engine, version, value = await generator.generate.call(
            requests, apply_newest=behind, then=partial(_read_reports, then)
        )
        self.reports.add(key, apply_s, weight, engine, version)
        return value

    def training_requests(self, picks: list[tuple[int, int]]) -> list[GenerationRequest]:
        """One request per ``(epoch, row)`` pick: ``group_size`` samples of its prompt."""
        prompt_ids = self.prompts.of_rows([i for _, i in picks])
        seed, group_size, sampling = self.seed, self.group_size, self.sampling
        min_version = self.versions.oldest_for_training()
        return [
            GenerationRequest(
                prompt_ids[i], group_size, sampling, sample_seed(seed, epoch, i), min_version
            )
            for epoch, i in picks
        ]

    async def generate_groups(self, generator, picks: list[tuple[int, int]]) -> tuple:
        """The groups of ``picks`` (one per prompt, its completions as columns: the trainer
        builds the rollouts it trains on, on its own thread), how many completions they
        hold, and their scorer payload (None: the scorer builds it)."""
        requests = self.training_requests(picks)
        build = partial(_groups_of, picks, requests, self.prompts.rows, self.prompts.key)
        results, groups, count, payload = await self.generate(generator, requests, build)
        if groups is None:  # texts to decode, with the loop's tokenizer
            groups = Group.from_results(
                picks,
                list(map(_prompt_ids, requests)),
                self.prompts.rows,
                self.prompts.key,
                results,
                self.prompts.decode_batch,
            )
        release_later((requests, results))  # (the groups hold what they need of them)
        return groups, count, payload

    async def episode_group(
        self, generator, env_factory: Callable[[], Any], epoch: int, index: int, max_turns: int
    ) -> Group:
        """One group of multi-turn episodes of row ``index`` (an environment task), one
        environment each, closed when the group ends."""
        envs = [env_factory() for _ in range(self.group_size)]
        try:
            rollouts = await self.run_episodes(
                envs,
                self.prompts.rows[index],
                index,
                lambda requests: self.generate(generator, self.require(requests)),
                self.sampling,
                sample_seed(self.seed, epoch, index),
                max_turns,
            )
        finally:
            for env in envs:
                env.close()
        return Group.of_rollouts(index, epoch, rollouts)

    def run_episodes(
        self,
        envs: list,
        row: dict,
        index: int,
        generate,
        sampling,
        seed: int,
        max_turns: int,
        stats: bool = True,
    ) -> Awaitable[list]:
        """The episodes of ``envs`` (text environments, or chat environments with tools) on
        ``row``, in lockstep; ``stats``: count them in ``episode/*`` (training episodes)."""
        from loomrl.envs.chat import ChatEnvironment

        if not isinstance(envs[0], ChatEnvironment):
            return run_group_episodes(
                envs,
                row,
                index,
                generate=generate,
                encode=self.prompts.encode_text,
                decode=self.prompts.decode,
                sampling=sampling,
                max_turns=max_turns,
                seed=seed,
            )
        from loomrl.envs.chat_episode import run_chat_episodes

        return run_chat_episodes(
            envs,
            row,
            index,
            generate=generate,
            tokenizer=self.prompts.tokenizer,
            sampling=sampling,
            limits=replace(self.chat_limits, max_turns=max_turns),
            seed=seed,
            stats=self.episode_stats if stats else None,
            model=self.model,
        )

    def require(
        self, requests: list[GenerationRequest], eval_: bool = False
    ) -> list[GenerationRequest]:
        """Raise each request's ``min_version`` to what it must run on: the published
        version for an evaluation, else what max_staleness allows."""
        needed = self.versions.published if eval_ else self.versions.oldest_for_training()
        for request in requests:
            request.min_version = max(request.min_version, needed)
        return requests
