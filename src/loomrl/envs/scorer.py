"""The scorer: turns generated rollouts into rewards, counting every failure."""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter, deque

from loomrl.config import TaskConfig
from loomrl.envs.reward import RewardFailure, call_reward_batch, load_object
from loomrl.types import Rollout

logger = logging.getLogger(__name__)


class JobFailedError(RuntimeError):
    """The job stopped because too many rollouts failed."""


class Scorer:
    """Scores rollouts with the task's reward function and tracks the failure rate."""

    def __init__(self, task: TaskConfig) -> None:
        self.task = task
        self.fn = load_object(task.reward) if task.reward else None
        if self.fn is not None and not callable(self.fn):
            raise TypeError(f"task.reward {task.reward!r} is not callable")
        self.failures_by_reason: Counter[str] = Counter()
        self.recent: deque[bool] = deque(maxlen=task.failure_window)
        self.last_error: str | None = None
        self.busy_s = 0.0

    def for_eval(self) -> Scorer:
        """The same reward with its own failure counts, so evaluation failures never mix
        into training's ``rollout/failed_*`` or its failure-rate limit."""
        twin = copy.copy(self)
        twin.failures_by_reason, twin.recent, twin.last_error, twin.busy_s = Counter(), deque(maxlen=1), None, 0.0
        return twin

    async def score(self, rollouts: list[Rollout]) -> None:
        """Set ``reward`` (or ``status='failed'`` and ``error``) on each rollout, in place."""
        if self.fn is None:
            return
        t0 = time.perf_counter()
        items = [(r.prompt, r.completion, r.row) for r in rollouts]
        for rollout, (value, seconds) in zip(rollouts, await call_reward_batch(self.fn, items,
                                                                               self.task.reward_timeout_s)):
            if isinstance(value, RewardFailure):
                self.record_failure(rollout, value.reason, str(value))
            else:
                rollout.reward = value
            rollout.timings["score_s"] = seconds
        self.busy_s += time.perf_counter() - t0

    def record_failure(self, rollout: Rollout, reason: str, message: str) -> None:
        rollout.status, rollout.error, rollout.reward = "failed", message, None
        self.failures_by_reason[reason] += 1
        self.last_error = message

    def record_outcomes(self, rollouts: list[Rollout]) -> None:
        """Feed outcomes into the failure-rate window; raise if the rate passes the limit."""
        self.recent.extend(r.status == "failed" for r in rollouts)
        min_seen = min(self.task.failure_window, 32)
        if len(self.recent) >= min_seen:
            rate = sum(self.recent) / len(self.recent)
            if rate > self.task.max_failure_rate:
                raise JobFailedError(
                    f"{rate:.0%} of the last {len(self.recent)} rollouts failed scoring "
                    f"(limit task.max_failure_rate={self.task.max_failure_rate}); "
                    f"last error: {self.last_error}"
                )
