"""The controller's side of scoring: ``Scorer`` turns generated groups into rewards,
counting every failure.

The reward runs in scorer executors (``task.num_scorers``, placed by the runtime: threads,
processes or Ray actors; ``scoring/base.py`` is their interface). ``Scorer`` sends each
batch to the least busy scorer and counts the outcomes; a batch whose scorer dies or hangs
goes once more to a (restarted) scorer, and is counted failed (``scorer_lost``) if that is
lost too.
"""

from __future__ import annotations

import copy
import logging
import operator
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from functools import partial
from itertools import repeat
from typing import Any

from loomrl.config_common import DataConfig
from loomrl.runtime.replicas import Replicas
from loomrl.runtime.supervision import ExecutorLostError
from loomrl.scoring.base import (
    SCORER_LOST,
    GroupOutcome,
    ScoreItem,
    ScoreOutcome,
    group_payload,
    lost_by_scorer,
    per_group_outcomes,
)
from loomrl.scoring.calls import call_reward_batch
from loomrl.scoring.config import TaskConfig
from loomrl.scoring.function import function_task, reward_outcomes
from loomrl.scoring.reward_list import drain_stats, load_reward
from loomrl.types import FailureKind, Group, Rollout

logger = logging.getLogger(__name__)

_status = operator.attrgetter("status")
_first, _second = operator.itemgetter(0), operator.itemgetter(1)


def _set_rewards(groups: list[Group], reply: tuple[list[GroupOutcome], Any]) -> tuple[list, Any]:
    """Where a ``score_groups`` call ended, off the loop: every scored group's rewards into
    its column; the others' ``(position, outcomes)``, for the loop to mark, and the
    executor's pool metrics."""
    failed = []
    for i, (group, (kind, value)) in enumerate(zip(groups, reply[0])):
        if kind == "ok":
            group.rewards = value
        else:
            failed.append((i, value))
    return failed, reply[1]


def merge_pool_metrics(per_executor: list[dict[str, float]]) -> dict[str, float]:
    """The ``sandbox/*`` metrics of several scorers' pools as one: counts and sizes add
    up; latencies (``*_ms``) and rates (``*_rate``) take the largest."""
    merged: dict[str, float] = {}
    for metrics in per_executor:
        for key, value in metrics.items():
            if key.endswith(("_ms", "_rate")):
                merged[key] = max(merged.get(key, value), value)
            else:
                merged[key] = merged.get(key, 0.0) + value
    return merged


class JobFailedError(RuntimeError):
    """The job stopped because too many rollouts failed."""


class Scorer:
    """Scores rollouts with the task's reward function and tracks the failure rate."""

    def __init__(self, task: TaskConfig, data: DataConfig | None = None) -> None:
        self.task = task
        task = function_task(task)
        # A model or judge scores in its executors.
        self.fn = load_reward(task, data) if task.scorer is None else None
        # (an environment scores in its episodes, an agent may return its own rewards)
        self.scores = task.has_reward
        self._reward_sums: dict[
            str, float
        ] = {}  # a reward list's reward/<name>_{sum,count} since the last step
        # Scorer executors (``Supervised`` slots), attached by the session; without them
        # the reward runs here, on this process's reward threads (a library user's Scorer).
        self.executors: Replicas = Replicas(())
        self.fault_stats: Any = None  # the run's FaultStats, with the executors
        self._pool_metrics: dict[str, dict[str, float]] = {}
        self._merged_pool_metrics: dict[str, float] | None = None
        self.failures_by_reason: Counter[str] = Counter()
        # each failure reason's first message (with its traceback)
        self._first_errors: dict[str, str] = {}
        self.recent: deque[bool] = deque(maxlen=task.failure_window)
        self.last_error: str | None = None
        self.busy_s = 0.0
        self.unanswered = 0  # rollouts no reward answered (all returned None), so far

    def for_eval(self) -> Scorer:
        """The same reward with its own failure counts, so evaluation failures never mix
        into training's ``rollout/failed_*`` or its failure-rate limit."""
        twin = copy.copy(self)
        twin.failures_by_reason, twin.recent, twin.last_error, twin.busy_s = (
            Counter(),
            deque(maxlen=1),
            None,
            0.0,
        )
        twin._reward_sums, twin._first_errors = {}, {}
        return twin

    def attach(self, executors: list[Any], fault_stats: Any) -> None:
        """Score on these scorer executors from now on."""
        self.executors, self.fault_stats = Replicas(executors), fault_stats

    async def score_groups(self, groups: list[Group], payload: tuple | None = None) -> None:
        """Score every rollout of ``groups`` as one batch, into their columns: a group
        gets its rewards as one list; a failed rollout is marked in its group
        (``Group.fail``) and counted (``rollout/failed_<reason>``, the failure-rate window
        when the caller records the outcomes). ``payload``: the groups' ``group_payload``,
        if the caller built it. Training and evaluation both score this way."""
        if not self.scores:
            return
        t0 = time.perf_counter()
        if self.executors and (
            payload is not None or (payload := group_payload(groups)) is not None
        ):
            # The common case: the rewards go into the groups where the call ended, off the loop.
            items, sizes = payload
            count = sum(sizes)
            lost = lambda message: per_group_outcomes(  # noqa: E731
                [("scorer_lost", message, 0.0)] * count, sizes
            )
            post = partial(_set_rewards, groups)
            failed = await self._score_remote(
                lambda slot: slot.score_groups.call(items, then=post), count, lost, post
            )
            for i, outcomes in failed:
                self._apply_to_group(groups[i], outcomes)
            self.busy_s += time.perf_counter() - t0
            return
        items: list[ScoreItem] = []
        for group in groups:
            items += zip(group.prompts, group.texts, repeat(group.row))
        outcomes = await self._outcomes(items)
        start = 0
        for group in groups:
            end = start + group.size
            self._apply_to_group(group, outcomes[start:end])
            start = end
        self.busy_s += time.perf_counter() - t0

    async def _outcomes(self, items: list[ScoreItem]) -> list[ScoreOutcome]:
        if self.executors:
            return await self._score_remote(
                lambda slot: slot.score.call(items),
                len(items),
                lambda message: [("scorer_lost", message, 0.0)] * len(items),
            )
        if self.fn is None:
            raise RuntimeError(
                "a task.scorer model or judge scores in scorer executors (loomrl.scoring.executor."
                "start_scorer_executor); attach them with Scorer.attach"
            )
        done = await call_reward_batch(self.fn, items, self.task.reward_timeout_s)
        self._add_reward_sums(drain_stats(self.fn))
        return reward_outcomes(done)

    def _add_reward_sums(self, sums: dict[str, float]) -> None:
        for key, value in sums.items():
            self._reward_sums[key] = self._reward_sums.get(key, 0.0) + value

    def reward_metrics(self) -> dict[str, float]:
        """Since the last call: each part of a reward list as ``reward/<name>_mean`` over the
        rollouts it answered and ``reward/<name>_none`` the rollouts it returned None for;
        ``reward/unanswered``, the rollouts no reward answered (0.0, as TRL gives them),
        when there were some (empty for a single reward that always answered)."""
        sums, self._reward_sums = self._reward_sums, {}
        out = {
            key.removesuffix("_sum") + "_mean": value / sums[key.removesuffix("_sum") + "_count"]
            for key, value in sums.items()
            if key.endswith("_sum") and sums[key.removesuffix("_sum") + "_count"]
        }
        out.update((k, v) for k, v in sums.items() if k.endswith("_none"))
        if sums.get("reward/unanswered"):
            self._warn_unanswered(sums["reward/unanswered"])
            out["reward/unanswered"] = sums["reward/unanswered"]
        return out

    def _warn_unanswered(self, count: float) -> None:
        """Say, the first time and then at each power of two, that no reward answered some
        rollouts (every reward returned None: TRL's warning)."""
        before, self.unanswered = self.unanswered, self.unanswered + int(count)
        if before == 0 or self.unanswered.bit_length() > before.bit_length():
            logger.warning(
                "%d rollouts so far got no reward: every reward function returned None for them "
                "(not applicable), so their reward is 0.0, as TRL's GRPOTrainer gives it; make at "
                "least one reward answer each sample (reward/unanswered counts them per step)",
                self.unanswered,
            )

    def _apply_to_group(self, group: Group, outcomes: list[ScoreOutcome]) -> None:
        if set(map(_first, outcomes)) <= {"ok"}:  # the common case: no pass in Python
            group.rewards = list(map(_second, outcomes))
            return
        for i, (status, value, _seconds) in enumerate(outcomes):
            if status == "ok":
                group.rewards[i] = value
            else:
                group.fail(i, status, self._count_failure(status, value))

    async def _score_remote(
        self,
        send: Callable[[Any], Awaitable[tuple]],
        count: int,
        lost: Callable[[str], list],
        post: Callable[[tuple], tuple] | None = None,
    ) -> list:
        """``send(scorer)`` (a call of ``count`` rollouts) to the least busy scorer; once more
        if that scorer is lost (it is restarted), then they count as failed: ``lost(message)``
        (``scorer_lost``). ``post``: what the call makes of the reply ``(outcomes, pool
        metrics)`` where it ended (applied here to ``lost``'s outcomes)."""
        for attempt in range(2):
            slot = self.executors.least_busy()  # (kept: each scorer's sandbox metrics are its own)
            try:
                outcomes, pool_metrics = await send(slot)
            except ExecutorLostError as err:
                if attempt == 0:
                    self.fault_stats.rescored_rollouts += count
                    continue
                self.fault_stats.lost_rollouts += count
                outcomes = lost(f"{SCORER_LOST}: {err}")
                return outcomes if post is None else post((outcomes, None))[0]
            if self.fn is not None and hasattr(self.fn, "reward_stats") and pool_metrics:
                pool_metrics = self._take_reward_sums(pool_metrics)
            if self._pool_metrics.get(slot.name) != pool_metrics:
                self._pool_metrics[slot.name], self._merged_pool_metrics = pool_metrics, None
            return outcomes
        raise AssertionError("unreachable")

    def _take_reward_sums(self, metrics: dict[str, float]) -> dict[str, float]:
        """``metrics`` less the reward list's sums a scorer executor sent with them (added up here)."""
        self._add_reward_sums({k: v for k, v in metrics.items() if k.startswith("reward/")})
        return {k: v for k, v in metrics.items() if not k.startswith("reward/")}

    def pool_metrics(self) -> dict[str, float]:
        """The scorer executors' sandbox pools, as one (see ``merge_pool_metrics``); merged
        again only when a scorer reported a change (read it, do not modify it)."""
        if self._merged_pool_metrics is None:
            self._merged_pool_metrics = merge_pool_metrics(list(self._pool_metrics.values()))
        return self._merged_pool_metrics

    def _count_failure(self, reason: FailureKind, message: str) -> str:
        """Count a failure; the 1st, 2nd, 4th, 8th ... one of each reason is logged with its
        message (which holds the value), so the log stays short. Its headline, to keep."""
        headline = message.partition("\n")[0]  # (a raised error's traceback follows its first line)
        count = self.failures_by_reason[reason] = self.failures_by_reason[reason] + 1
        self.last_error = headline
        self._first_errors.setdefault(reason, message)
        # the first one of a reason with its traceback, the later ones without
        if count & (count - 1) == 0:
            logger.warning(
                "rollout failed scoring (%s, %d so far): %s",
                reason,
                count,
                message if count == 1 else headline,
            )
        return headline

    def failure_counts(self) -> Counter[str]:
        """Failures so far by reason (a copy: ``rollout/failed_<reason>``)."""
        return Counter(self.failures_by_reason)

    def first_failures(self) -> dict[str, str]:
        """Each failure reason's first message, traceback and all (a copy: summary.json's
        ``first_failures``)."""
        return dict(self._first_errors)

    def count_environment_failures(self, errors: list[str | None]) -> None:
        """Count episodes their environment failed (``environment``; ``errors`` their
        messages, the last one kept for the failure-rate limit's message). Their episode
        logged them where it ended; they are not logged again here."""
        for error in errors:
            self.failures_by_reason["environment"] += 1
            self.last_error = error

    def record_ok(self, count: int) -> None:
        """``count`` rollouts scored without a failure, into the failure-rate window (which
        only falls: no check)."""
        self.recent.extend([False] * count)

    def record_outcomes(self, rollouts: list[Rollout]) -> None:
        """Feed outcomes into the failure-rate window; raise if the rate passes the limit.
        Rollouts no scorer could score are the executors' failure, not the reward's: they
        stay out of the window (and their prompt goes out again)."""
        if set(map(_status, rollouts)) <= {"ok"}:  # the common case: no pass in Python
            self.recent.extend([False] * len(rollouts))
        else:
            self.recent.extend([r.status == "failed" for r in rollouts if not lost_by_scorer(r)])
        min_seen = min(self.task.failure_window, 32)
        if len(self.recent) >= min_seen:
            rate = sum(self.recent) / len(self.recent)
            if rate > self.task.max_failure_rate:
                raise JobFailedError(
                    f"{rate:.0%} of the last {len(self.recent)} rollouts failed scoring "
                    f"(limit task.max_failure_rate={self.task.max_failure_rate}); "
                    f"last error: {self.last_error}"
                )
