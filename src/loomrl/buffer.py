"""The staleness gate and the rollout buffer (see shared ASYNC.md for the exact rules)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from loomrl.types import Group


class StalenessGate:
    """Admits a new group only while ``accepted + running < (max_staleness + v + 1) * B``.

    ``accepted`` counts groups in the buffer or trained on (dropped and failed groups leave
    it); ``running`` counts groups being generated or scored.
    """

    def __init__(self, max_staleness: int, groups_per_step: int) -> None:
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        self.version = 0
        self.accepted = 0
        self.running = 0
        self._changed = asyncio.Condition()

    def capacity(self) -> int:
        limit = (self.max_staleness + self.version + 1) * self.groups_per_step
        return max(0, limit - self.accepted - self.running)

    async def acquire(self, wanted: int) -> int:
        """Wait until at least one group may start; start up to ``wanted``; returns how many."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.capacity() > 0)
            n = min(wanted, self.capacity())
            self.running += n
            return n

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def finish(self, accepted: bool) -> None:
        """A running group ended: delivered to the buffer, or failed/abandoned."""
        await self.finish_many(1, int(accepted))

    async def finish_many(self, count: int, accepted: int) -> None:
        """``count`` running groups ended (one request's), ``accepted`` of them delivered to
        the buffer: one wake-up of the waiters for all of them."""
        self.running -= count
        self.accepted += accepted
        await self._notify()

    async def release_accepted(self) -> None:
        """An accepted group was dropped (stale) instead of trained."""
        self.accepted -= 1
        await self._notify()

    async def set_version(self, version: int) -> None:
        self.version = version
        await self._notify()


@dataclass
class Batch:
    groups: list[Group]
    staleness: list[int] = field(default_factory=list)  # per trained group: version - min_version


class RolloutBuffer:
    """Full groups waiting for the trainer. ``take`` drops groups that are too stale."""

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self.groups: list[Group] = []
        self._min_versions: list[int] = []  # each group's min_version, taken once when it arrives
        self._changed = asyncio.Condition()

    @property
    def num_rollouts(self) -> int:
        return sum(len(g.rollouts) for g in self.groups)

    async def put(self, group: Group) -> None:
        await self.put_many([group])

    async def put_many(self, groups: list[Group]) -> None:
        """Add ``groups`` (one request's) with one wake-up of the trainer for all of them."""
        async with self._changed:
            self.groups.extend(groups)
            self._min_versions.extend(g.min_version for g in groups)
            self._changed.notify_all()

    async def take(self, count: int, version: int, on_drop) -> Batch:
        """Wait for ``count`` groups fresh enough for ``version``; stale ones go to ``on_drop``.

        The batch is ordered by (epoch, prompt index), so a synchronous run's batch does
        not depend on the order in which scoring finished.
        """
        async with self._changed:
            while True:
                oldest = version - self.max_staleness
                if self._min_versions and min(self._min_versions) < oldest:
                    stale = [g for g, v in zip(self.groups, self._min_versions) if v < oldest]
                    kept = [(g, v) for g, v in zip(self.groups, self._min_versions) if v >= oldest]
                    self.groups, self._min_versions = [g for g, _ in kept], [v for _, v in kept]
                    for g in stale:
                        await on_drop(g)
                if len(self.groups) >= count:
                    break
                await self._changed.wait()
            chosen, self.groups = self.groups[:count], self.groups[count:]
            versions, self._min_versions = self._min_versions[:count], self._min_versions[count:]
        order = sorted(range(len(chosen)), key=lambda i: (chosen[i].epoch, chosen[i].prompt_index))
        return Batch([chosen[i] for i in order], staleness=[version - versions[i] for i in order])
