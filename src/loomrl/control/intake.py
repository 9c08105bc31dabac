"""Intake: a request's generated groups scored and put in the buffer.

A request's groups are scored as one batch and enter the buffer together (one wake-up of
the trainer and of the gate per request, not per group). A failed rollout is counted and
left out (never trained on); a group left with none frees its place at the gate, and one
that every scorer lost goes out again (``Requeues.lost_scoring``). With dynamic sampling a
group with nothing to learn from is dropped here too (``DynamicSampling``). Rollouts
count as in flight while they are scored here or wait in the buffer.
"""

from __future__ import annotations

import asyncio
import operator

from loomrl.config import JobConfig
from loomrl.control.background import Background
from loomrl.control.buffer import RolloutBuffer, StalenessGate
from loomrl.control.dynamic_sampling import DynamicSampling
from loomrl.control.requeues import Requeues
from loomrl.scoring.base import lost_by_scorer
from loomrl.scoring.client import Scorer
from loomrl.types import Group, Rollout

_all_ok = operator.attrgetter("all_ok")


class Intake:
    def __init__(
        self,
        scorer: Scorer,
        buffer: RolloutBuffer,
        gate: StalenessGate,
        counters,
        requeues: Requeues,
        background: Background,
        cfg: JobConfig | None = None,
    ) -> None:
        """``cfg``: the job's, for ``algorithm.dynamic_sampling`` (None: off)."""
        self.scorer, self.buffer, self.gate = scorer, buffer, gate
        self.counters, self.requeues, self.background = counters, requeues, background
        # algorithm.dynamic_sampling (a no-op when it is off)
        self.dynamic_sampling = DynamicSampling.of(cfg, requeues.stream, counters, buffer)
        self.scoring: set[asyncio.Task] = set()  # requests being scored
        self.scoring_rollouts = 0

    @property
    def in_flight(self) -> int:
        """Rollouts generated but not yet trained, dropped or failed, counted where they are."""
        return self.buffer.num_rollouts + self.scoring_rollouts

    def add(self, groups: list[Group], count: int, payload: tuple | None = None) -> None:
        """Score ``groups`` (one request's, ``count`` rollouts; ``payload`` their scorer
        payload, if built) and put them in the buffer, in a task of their own."""
        self.counters.generated += count
        self.scoring_rollouts += count
        task = asyncio.create_task(self._score_and_put(groups, count, payload))
        self.background.watch(task, self.scoring)

    async def add_episodes(self, group: Group) -> None:
        """``add`` for a group of episodes, awaited here (it has a task of its own already);
        an episode its environment failed counts as an ``environment`` failure."""
        if not group.all_ok:
            self.scorer.count_environment_failures([r.error for r in group if r.status == "failed"])
        groups, count = [group], group.size
        self.counters.generated += count
        self.scoring_rollouts += count
        await self._score_and_put(groups, count, None)

    async def _score_and_put(self, groups: list[Group], count: int, payload: tuple | None) -> None:
        try:
            await self.scorer.score_groups(groups, payload)
        finally:  # they leave "scoring" just as they enter the buffer (or fail)
            self.scoring_rollouts -= count
        if all(map(_all_ok, groups)):  # the common case: nothing to look at per rollout
            kept, outcomes = groups, None
        else:
            kept, outcomes = self._drop_failed(groups)
        kept = self.dynamic_sampling.keep(kept)
        if kept:
            await self.buffer.put_many(kept)
        await self.gate.finish_many(len(groups), len(kept))
        if outcomes is None:
            self.scorer.record_ok(count)
        else:
            self.scorer.record_outcomes(outcomes)

    def _drop_failed(self, groups: list[Group]) -> tuple[list[Group], list[Rollout]]:
        """Count the failed rollouts of ``groups``; the groups left with any rollout (each
        without its failed ones), and every outcome for the failure-rate window."""
        outcomes: list[Rollout] = []  # failed and ok
        kept: list[Group] = []
        for group in groups:
            rows = list(group)
            ok = [r for r in rows if r.status == "ok"]
            if len(ok) < len(rows):
                self.counters.failed += len(rows) - len(ok)
                outcomes += [r for r in rows if r.status != "ok"]
                if all(map(lost_by_scorer, rows)):  # scorers lost it, not the reward
                    self.requeues.lost_scoring(group)
            outcomes += ok
            if ok:
                kept.append(group.without_failed())
        return kept, outcomes

    async def settle(self, timeout_s: float | None) -> None:
        """Let scoring in progress land in the buffer, so every rollout stays accounted
        (``timeout_s``: after a Ctrl-C only briefly; what is still scoring stays in flight)."""
        if self.scoring:
            await asyncio.wait(list(self.scoring), timeout=timeout_s)
