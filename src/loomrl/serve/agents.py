"""``task.agent``: an ordinary ``openai``-client program run as the job's episodes.

``AgentEpisodes.group(row, ...)`` runs ``await agent(client, row)`` ``group_size`` times at
once, each with an ``openai.AsyncOpenAI`` whose base URL binds it to an episode of the
job's endpoint (``/e/<id>/v1``). What the agent returns is the episode's reward: a number,
a dict with ``reward`` and other numbers (logged as ``agent/<name>_mean``), or None (the
task's reward function then scores the last answer, with the row's prompt). The episode's
requests become its samples (``loomrl.serve.episodes.merge_calls``), each with the reward.

An agent that raises, returns something else or runs past ``serve.episode_timeout_s``
fails its own episode only: a failed rollout (counted by kind as
``agent/failed_<raised|invalid|timeout>``, the first traceback of each kind kept), never
the group's other episodes.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import ssl
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from loomrl.scoring.calls import RewardFailure, check_value
from loomrl.serve.episodes import Episode, EpisodeBook, EpisodeError, Sample, merge_calls
from loomrl.types import Group, Rollout

logger = logging.getLogger(__name__)

Agent = Callable[[openai.AsyncOpenAI, dict[str, Any]], Awaitable[Any]]


class AgentFailure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Outcome:
    """One finished episode: its samples and reward, or why it failed."""

    samples: list[Sample]
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    failure: str | None = None  # raised, invalid, timeout
    error: str | None = None
    last_text: str = ""


def read_result(value: Any) -> tuple[float | None, dict[str, float]]:
    """An agent's return value as (reward, metrics); ``AgentFailure('invalid')`` otherwise."""
    if value is None:
        return None, {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise AgentFailure(
                "invalid", f"the agent returned a dict without 'reward': {sorted(value)}"
            )
        metrics = {k: v for k, v in value.items() if k != "reward"}
        bad = [
            k for k, v in metrics.items() if not isinstance(v, (int, float)) or isinstance(v, bool)
        ]
        if bad:
            raise AgentFailure("invalid", f"the agent's metrics {bad} are not numbers")
        reward, _ = read_result(value["reward"])
        return reward, {k: float(v) for k, v in metrics.items()}
    try:
        return check_value(value), {}
    except RewardFailure as err:
        raise AgentFailure("invalid", f"the agent returned {value!r}: {err}") from None


class AgentEpisodes:
    """The job's agent episodes over its endpoint (module docstring)."""

    def __init__(
        self, agent: Agent | None, book: EpisodeBook, url: str, token: str, timeout_s: float
    ) -> None:
        self.agent, self.book, self.url, self.token = agent, book, url, token
        self.timeout_s = timeout_s
        # agent None ('external'): episodes wait here for a harness (POST /v1/episodes)
        self.external = agent is None
        # (an httpx client builds a TLS context when made unless handed one: 90 ms each)
        self._tls = ssl.create_default_context()
        self.waiting: asyncio.Queue[Episode] = asyncio.Queue()
        self.failures: Counter[str] = Counter()
        self.first_errors: dict[str, str] = {}
        self.num_episodes = 0
        self.num_split = 0  # samples started by a request that did not extend the one before
        self._metric_sums: Counter[str] = Counter()

    def client(self, episode: Episode, http: httpx.AsyncClient) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/e/{episode.id}/v1",
            api_key=self.token,
            max_retries=0,
            http_client=http,
        )

    async def run_one(self, row: dict[str, Any]) -> Outcome:
        """One episode of ``row``: the agent run to its end (or, ``external``, a harness's
        episode claimed and closed), its requests merged."""
        timeout_s = self.book.deadline_s if self.external else self.timeout_s
        episode = self.book.start(row, deadline_s=timeout_s + 60.0)
        self.num_episodes += 1
        try:
            value = await asyncio.wait_for(self._episode(episode, row), timeout_s)
            reward, metrics = read_result(value)
            outcome = Outcome([], reward, metrics)
        except TimeoutError:
            outcome = self._failed("timeout", f"the episode ran past {timeout_s:g} s")
        except AgentFailure as err:
            outcome = self._failed(err.kind, str(err))
        except Exception as err:  # noqa: BLE001 - user agent code: fails its own episode only
            outcome = self._failed("raised", f"{type(err).__name__}: {err}", traceback.format_exc())
        if episode.id in self.book.open:
            self.book.close(episode.id, None, outcome.error or "the agent returned")
        outcome.samples = merge_calls(episode.calls)
        outcome.last_text = episode.calls[-1].text if episode.calls else ""
        if outcome.failure is None and not outcome.samples:
            outcome = self._failed("invalid", "the agent made no request to the endpoint")
        self.num_split += max(len(outcome.samples) - 1, 0)
        for name, value in outcome.metrics.items():
            self._metric_sums[name] += value
        return outcome

    async def _episode(self, episode: Episode, row: dict[str, Any]) -> Any:
        """What the agent returns, or what a harness closed the episode with."""
        if self.agent is not None:
            # A connection of its own per episode: one pool shared by hundreds of episodes
            # costs httpcore time quadratic in its connections.
            async with httpx.AsyncClient(timeout=self.timeout_s, verify=self._tls) as http:
                return await self.agent(self.client(episode, http), dict(row))
        self.waiting.put_nowait(episode)
        return await episode.closed

    async def claim(self, wait_s: float = 30.0) -> Episode:
        """The next episode for a harness, waiting up to ``wait_s`` for the job to start one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            try:
                episode = await asyncio.wait_for(self.waiting.get(), max(deadline - loop.time(), 0))
            except TimeoutError:
                raise EpisodeError(
                    503, f"no episode waiting for a harness after {wait_s:g} s"
                ) from None
            if episode.id in self.book.open:
                return episode

    def _failed(self, kind: str, message: str, trace: str | None = None) -> Outcome:
        self.failures[kind] += 1
        self.first_errors.setdefault(kind, trace or message)
        if self.failures[kind] == 1:
            logger.warning("an agent episode failed (%s): %s", kind, message)
        return Outcome([], failure=kind, error=f"agent {kind}: {message}")

    async def group(
        self, row: dict[str, Any], index: int, epoch: int, size: int, prompt: str, scorer
    ) -> Group:
        """``size`` episodes of ``row`` at once, as one group of their samples; samples
        whose agent returned no reward scored by ``scorer`` (the task's reward)."""
        outcomes = await asyncio.gather(*(self.run_one(row) for _ in range(size)))
        rollouts = [
            r for outcome in outcomes for r in self.rollouts_of(outcome, row, index, prompt)
        ]
        await self._score_missing(rollouts, index, epoch, scorer)
        return Group.of_rollouts(index, epoch, rollouts)

    async def _score_missing(self, rollouts: list[Rollout], index: int, epoch: int, scorer) -> None:
        needy = [r for r in rollouts if r.status == "ok" and r.reward is None]
        if not needy:
            return
        if not scorer.scores:
            for r in needy:
                r.status, r.failure = "failed", "environment"
                r.error = "agent invalid: it returned None and the task has no reward to score it"
            self.failures["invalid"] += len(needy)
            return
        scored = Group.of_rollouts(index, epoch, needy)
        await scorer.score_groups([scored])
        for r, done in zip(needy, scored):
            r.reward, r.status, r.error, r.failure = (
                done.reward,
                done.status,
                done.error,
                done.failure,
            )

    def rollouts_of(self, outcome: Outcome, row: dict, index: int, prompt: str) -> list[Rollout]:
        if outcome.failure is not None or not outcome.samples:
            return [
                Rollout(
                    index,
                    [],
                    [],
                    [],
                    [],
                    0,
                    prompt,
                    "",
                    row,
                    None,
                    "failed",
                    outcome.error,
                    failure="environment",
                )
            ]
        return [
            Rollout(
                index,
                s.prompt_ids,
                s.completion_ids,
                s.logprobs,
                s.loss_mask,
                min(s.versions),
                prompt,
                outcome.last_text,
                row,
                outcome.reward,
                finish_reason=s.finish_reason,
                num_turns=s.num_turns,
            )
            for s in outcome.samples
        ]

    def metrics(self) -> dict[str, float]:
        done = max(self.num_episodes, 1)
        out = {
            "agent/episodes": float(self.num_episodes),
            "agent/split_samples": float(self.num_split),
            **{f"agent/failed_{kind}": float(n) for kind, n in self.failures.items()},
            **{f"agent/{name}_mean": total / done for name, total in self._metric_sums.items()},
        }
        return out

    async def close(self) -> None:
        """Nothing held between episodes (each closes its own connection)."""


EXTERNAL = "external"


def load_agent(path: str) -> Agent | None:
    """``task.agent``: an ``async def fn(client, row)`` by import path; 'external' (None):
    a harness in another process runs the episodes through ``POST /v1/episodes``."""
    from loomrl.scoring.calls import load_object

    if path == EXTERNAL:
        return None
    fn = load_object(path)
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(
            f"task.agent {path!r} must be an async function `async def fn(client, row)`"
        )
    return fn
