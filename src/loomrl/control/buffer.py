"""The staleness gate and the rollout buffer (docs/async.md states the exact rules)."""

from __future__ import annotations

import asyncio
import operator
from dataclasses import dataclass, field

from loomrl.types import Group


class _Waiters:
    """Coroutines waiting for a change, woken all at once. The gate and the buffer live on
    one event loop and change only between awaits, so no lock is needed (an
    ``asyncio.Condition`` costs a lock and two futures per wait and per wake-up, on the
    controller's loop, every step)."""

    __slots__ = ("_futures",)

    def __init__(self) -> None:
        self._futures: list[asyncio.Future] = []

    async def wait(self) -> None:
        future = asyncio.get_running_loop().create_future()
        self._futures.append(future)
        try:
            await future
        finally:  # (a cancelled waiter leaves no future behind)
            if not future.done():
                self._futures.remove(future)

    def wake(self) -> None:
        futures, self._futures = self._futures, []
        for future in futures:
            if not future.done():
                future.set_result(None)


class StalenessGate:
    """Admits a new group only while ``accepted + running < (max_staleness + v + 1) * B``.

    ``accepted`` counts groups in the buffer or trained on (dropped and failed groups leave
    it); ``running`` counts groups being generated or scored.
    """

    def __init__(self, max_staleness: int, groups_per_step: int, version: int = 0) -> None:
        """A gate at ``version``: a run resumed there has trained ``version`` steps' groups."""
        self.max_staleness = max_staleness
        self.groups_per_step = groups_per_step
        self.version = version
        self.accepted = version * groups_per_step
        self.running = 0
        self._waiters = _Waiters()

    def capacity(self) -> int:
        limit = (self.max_staleness + self.version + 1) * self.groups_per_step
        return max(0, limit - self.accepted - self.running)

    async def acquire(self, wanted: int) -> int:
        """Wait until at least one group may start; start up to ``wanted``; returns how many."""
        while self.capacity() <= 0:
            await self._waiters.wait()
        n = min(wanted, self.capacity())
        self.running += n
        return n

    async def finish(self, accepted: bool) -> None:
        """A running group ended: delivered to the buffer, or failed/abandoned."""
        await self.finish_many(1, int(accepted))

    async def finish_many(self, count: int, accepted: int) -> None:
        """``count`` running groups ended (one request's), ``accepted`` of them delivered to
        the buffer: one wake-up of the waiters for all of them."""
        self.running -= count
        self.accepted += accepted
        self._wake_if_open()

    async def release_accepted(self) -> None:
        """An accepted group was dropped (stale) instead of trained."""
        self.accepted -= 1
        self._wake_if_open()

    async def count_as_taken(self, count: int) -> None:
        """A step trained ``count`` groups short of a full batch (dynamic sampling at its
        bound): their places count as taken, as a full step's would, so the next version
        admits one batch and no more."""
        self.accepted += count

    async def set_version(self, version: int) -> None:
        self.version = version
        self._wake_if_open()

    def _wake_if_open(self) -> None:
        # Only when a group may start: a request whose groups were all accepted frees no
        # place, and waking the generation loop for nothing costs it a turn on the loop.
        if self.capacity() > 0:
            self._waiters.wake()


_size, _min_version, _epoch_and_index = (
    operator.attrgetter(*a) for a in (("size",), ("min_version",), ("epoch", "prompt_index"))
)


@dataclass
class Batch:
    groups: list[Group]
    staleness: list[int] = field(default_factory=list)  # per trained group: version - min_version
    sizes: list[int] = field(default_factory=list)  # per trained group: its rollouts, as it arrived


class RolloutBuffer:
    """Full groups waiting for the trainer. ``take`` drops groups that are too stale."""

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = max_staleness
        self.groups: list[Group] = []
        # Each group's min_version and size, taken once when it arrives (nothing changes a
        # group in the buffer), and their rollouts in all: no pass over the groups a step.
        self._min_versions: list[int] = []
        self._sizes: list[int] = []
        self.num_rollouts = 0
        self._waiters = _Waiters()
        self._interrupted = False
        self._short_ok = False

    async def put_many(self, groups: list[Group]) -> None:
        """Add ``groups`` (one request's) with one wake-up of the trainer for all of them."""
        sizes = list(map(_size, groups))
        self.groups.extend(groups)
        self._min_versions.extend(map(_min_version, groups))
        self._sizes.extend(sizes)
        self.num_rollouts += sum(sizes)
        self._waiters.wake()

    def allow_short(self) -> None:
        """The next ``take`` returns what it has as soon as it has any group, fewer than it
        asked for if so (dynamic sampling spent its bound; ``take`` clears this)."""
        self._short_ok = True
        self._waiters.wake()

    def interrupt(self) -> None:
        """A ``take`` waiting now or later returns None unless its batch is there already
        (a stop was requested: Ctrl-C must not wait for a batch that may never come)."""
        self._interrupted = True
        self._waiters.wake()

    async def take(self, count: int, version: int, on_drop) -> Batch | None:
        """Wait for ``count`` groups fresh enough for ``version``; stale ones go to ``on_drop``;
        None once ``interrupt`` was called.

        The batch is ordered by (epoch, prompt index), so a synchronous run's batch does
        not depend on the order in which scoring finished.
        """
        while True:
            oldest = version - self.max_staleness
            if self._min_versions and min(self._min_versions) < oldest:
                entries = list(zip(self.groups, self._min_versions, self._sizes))
                stale = [g for g, v, _ in entries if v < oldest]
                kept = [e for e in entries if e[1] >= oldest]
                self.groups, self._min_versions, self._sizes = (
                    [e[0] for e in kept],
                    [e[1] for e in kept],
                    [e[2] for e in kept],
                )
                self.num_rollouts = sum(self._sizes)
                for g in stale:
                    await on_drop(g)
                continue  # (on_drop awaited: look again before taking)
            if len(self.groups) >= count:
                break
            if self._short_ok and self.groups:
                count = len(self.groups)
                break
            if self._interrupted:
                return None
            await self._waiters.wait()
        self._short_ok = False
        chosen, self.groups = self.groups[:count], self.groups[count:]
        versions, self._min_versions = self._min_versions[:count], self._min_versions[count:]
        sizes, self._sizes = self._sizes[:count], self._sizes[count:]
        self.num_rollouts -= sum(sizes)
        order = sorted(range(len(chosen)), key=list(map(_epoch_and_index, chosen)).__getitem__)
        return Batch(
            [chosen[i] for i in order],
            staleness=[version - versions[i] for i in order],
            sizes=[sizes[i] for i in order],
        )
