"""One device shared by a job's generators and its trainer (``generation.colocate``).

The controller runs each device phase as ``await phases.run(name, call)`` (as it does in a
scheduler lease). ``generate`` is the generators' turn; every other phase (``train``,
``weight_sync``, ``checkpoint``) is the trainer's. Phases of one side may overlap (two
generators generate at once); the two sides never do. A change of side waits for the
phases in progress to end, offloads the side that had the device (``offload()`` on each of
its executors) and restores the side that comes (``restore()``), so only one side's state
is on the device at a time: the natural setup of a user with one GPU.

Turns are fair: once a phase of the other side waits, no new phase of the side holding the
device starts, so an async job's generation loops cannot starve its trainer (nor the
reverse). A call whose executor was lost and replaced is not retried here: the fresh
executor holds nothing to move. Which errors mean that is the runtime's to say (``replaced``,
given by whoever builds the phases): this layer knows devices, not executors.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

GENERATE, TRAIN = "generate", "train"


def side_of(phase: str) -> str:
    """The side a phase belongs to: the generators' for ``generate``, else the trainer's."""
    return GENERATE if phase == GENERATE else TRAIN


def other_side(side: str) -> str:
    return TRAIN if side == GENERATE else GENERATE


class ColocatedPhases:
    """Device phases of colocated generators and trainer, one side at a time."""

    publish_in_train_phase = True  # a step and its publish in one trainer turn (no switch between)

    def __init__(
        self, trainer: Any, generators: list[Any], replaced: Callable[[BaseException], bool]
    ) -> None:
        self.handles = {TRAIN: [trainer], GENERATE: list(generators)}
        # whether an offload's or restore's error means its executor was replaced (empty)
        self.replaced = replaced
        self.holder: str | None = None  # the side whose state is on the device
        self.running = 0  # phases of ``holder`` in progress
        self.waiting = {TRAIN: 0, GENERATE: 0}
        self._switching = False
        self._changed: asyncio.Condition | None = None  # made on the running loop
        self.stats = {"switches": 0, "offload_s": 0.0, "restore_s": 0.0, "wait_s": 0.0}

    async def run(self, phase: str, call: Callable[[], Awaitable[Any]]) -> Any:
        """Await ``call()`` once its side holds the device (switching sides if needed)."""
        side = side_of(phase)
        await self._enter(side)
        try:
            return await call()
        finally:
            await self._exit()

    def _may_enter(self, side: str) -> bool:
        if self._switching:
            return False
        if self.holder == side:  # fair: once the other side waits, it goes first
            return self.waiting[other_side(side)] == 0
        return self.running == 0

    async def _enter(self, side: str) -> None:
        if self._changed is None:
            self._changed = asyncio.Condition()
        t0 = time.perf_counter()
        # counted before taking the condition's lock (one event loop: no race), so a phase
        # of the other side woken in the meantime already sees this one waiting
        self.waiting[side] += 1
        try:
            async with self._changed:
                await self._changed.wait_for(lambda: self._may_enter(side))
                switch = self.holder != side
                if switch:
                    self._switching = True
                else:
                    self.running += 1
        finally:
            self.waiting[side] -= 1
        self.stats["wait_s"] += time.perf_counter() - t0
        if switch:
            await self._switch_to(side)

    async def _switch_to(self, side: str) -> None:
        """Offload the holder's executors, restore ``side``'s; then ``side`` holds the
        device with this phase running. Shielded: a phase cancelled meanwhile lets the move
        finish (no device is left half switched) and then gives up its turn."""
        task = asyncio.ensure_future(self._move(side))
        cancelled = False
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
            await asyncio.wait([task])
        except Exception:  # noqa: BLE001 - read from the task below
            pass
        moved = not task.cancelled() and task.exception() is None
        async with self._changed:
            self._switching = False
            # after a failed move nobody knows where the state is: the next phase moves both
            self.holder = side if moved else None
            self.running += int(moved and not cancelled)
            self._changed.notify_all()
        if cancelled:
            raise asyncio.CancelledError
        task.result()  # a failed offload or restore fails the phase

    async def _move(self, side: str) -> None:
        # at the first phase both sides are on the device (as loaded): the other one leaves
        leaving = self.holder or other_side(side)
        offload, restore = (lambda h: h.offload()), (lambda h: h.restore())
        self.stats["offload_s"] += await _on_all(self.handles[leaving], offload, self.replaced)
        self.stats["restore_s"] += await _on_all(self.handles[side], restore, self.replaced)
        self.stats["switches"] += 1
        logger.debug("colocated device: %s -> %s", self.holder, side)

    async def _exit(self) -> None:
        async with self._changed:
            self.running -= 1
            self._changed.notify_all()

    def metrics(self) -> dict[str, float]:
        """``colocate/*``: side switches, seconds offloading and restoring, seconds phases
        waited for their side's turn."""
        return {f"colocate/{k}": float(v) for k, v in self.stats.items()}

    def close(self) -> None:
        return None


async def _on_all(
    handles: list[Any],
    call: Callable[[Any], Awaitable[Any]],
    replaced: Callable[[BaseException], bool],
) -> float:
    """``call(handle)`` (its ``offload()`` or ``restore()``) on every handle at once; the
    seconds they took, summed (an engine without a real offload answers None, counted as 0;
    a handle whose executor was ``replaced`` while it ran, as 0 too)."""

    async def one(handle: Any) -> float:
        try:
            return await call(handle) or 0.0
        except Exception as err:
            if not replaced(err):
                raise
            return 0.0

    return sum(await asyncio.gather(*(one(h) for h in handles)))
