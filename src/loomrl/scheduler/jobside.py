"""A loomrl job under the scheduler (``scheduler.url`` set): its device phases in leases.

The controller runs each device phase (generate, train, weight_sync, checkpoint) as
``await leases.run(name, call)``. Inside: the lease is held, the executors' state is back
on the device if it had left, and on a CPU device the job's threads (and the executor
processes) run on the lease's cores. After: the lease is released; when another job waits
for the device, the executors offload first (``offload()`` on each). The blocking HTTP
calls run in worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from contextlib import contextmanager
from typing import Any

from loomrl.runtime.supervision import ExecutorLostError
from loomrl.scheduler.client import Lease, SchedulerClient, pinned, pinned_threads
from loomrl.scheduler.config import SchedulerConfig

logger = logging.getLogger(__name__)


class _ExecutorState:
    """The executors' ``offload``/``restore``, callable from the client's threads."""

    def __init__(self, handles: list[Any], loop: asyncio.AbstractEventLoop) -> None:
        self.handles, self.loop = handles, loop

    def _all(self, endpoint: Callable[[Any], Awaitable[float | None]]) -> float:
        """``endpoint(handle)`` on every executor at once; the seconds they took, summed."""

        async def one(handle: Any) -> float:
            try:
                # an engine without a real offload answers None
                return await endpoint(handle) or 0.0
            except ExecutorLostError as err:  # replaced: the fresh executor holds nothing to move
                if not err.restarted:
                    raise
                return 0.0

        async def call() -> float:
            return sum(await asyncio.gather(*(one(h) for h in self.handles)))

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result()

    def offload(self) -> float:
        return self._all(lambda handle: handle.offload())

    def restore(self) -> float:
        return self._all(lambda handle: handle.restore())


class JobLeases:
    # training and weight sync stay phases of their own: another job may come between them
    publish_in_train_phase = False

    def __init__(self, cfg: SchedulerConfig, job_name: str, handles: list[Any]) -> None:
        self.cfg = cfg
        self.client = SchedulerClient(
            cfg.url,
            job_name,
            priority=cfg.priority,
            weight=cfg.weight,
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
            pin=cfg.pin,
        )
        self.handles = handles
        self._state: _ExecutorState | None = None
        self.waited_s = 0.0
        logger.info("scheduler %s: job %r shares device %r", cfg.url, job_name, cfg.device)

    def _attach(self) -> None:
        if self._state is None and self.cfg.offload:
            self._state = _ExecutorState(self.handles, asyncio.get_running_loop())
            self.client.attach(self._state)

    async def run(self, phase: str, call: Callable[[], Awaitable[Any]]) -> Any:
        """Await ``call()`` (an executor call) holding a lease for ``phase``.

        Cancellation-safe: a task cancelled while it waits for the lease gives the lease
        back as soon as it comes; one cancelled while the executor computes keeps the lease
        until the executor is done (a thread cannot be stopped), so no other job's phase
        and no offload ever overlaps it."""
        self._attach()
        enter = asyncio.ensure_future(asyncio.to_thread(self._enter, phase))
        try:
            lease = await asyncio.shield(enter)
        except asyncio.CancelledError:
            enter.add_done_callback(self._exit_when_granted)
            raise
        work = asyncio.ensure_future(call())
        try:
            with self._pinned(lease.cores):
                try:
                    return await asyncio.shield(work)
                except asyncio.CancelledError:
                    await asyncio.wait([work])
                    raise
        finally:
            await asyncio.to_thread(self._exit, lease)

    def _enter(self, phase: str) -> Lease:
        lease = self.client.acquire(self.cfg.device, phase, timeout_s=self.cfg.acquire_timeout_s)
        self.client.state_lock.acquire()
        try:
            self.client.begin(lease)
        except BaseException:
            self._exit(lease)
            raise
        return lease

    def _exit(self, lease: Lease) -> None:
        try:
            self.client.end(lease)
        finally:
            self.client.state_lock.release()

    def _exit_when_granted(self, enter: asyncio.Future) -> None:
        if not enter.cancelled() and enter.exception() is None:
            threading.Thread(target=self._exit, args=(enter.result(),), daemon=True).start()

    @contextmanager
    def _pinned(self, cores: list[int] | None):
        if not (self.cfg.pin and cores):
            yield
            return
        pids = sorted({h.pid for h in self.handles if h.pid not in (None, os.getpid())})
        with pinned(cores, whole_process=True), _pinned_pids(cores, pids):
            yield

    def metrics(self) -> dict[str, float]:
        s = self.client.stats
        return {
            "scheduler/wait_s": s["wait_s"],
            "scheduler/held_s": s["held_s"],
            "scheduler/offload_s": s["offload_s"],
            "scheduler/restore_s": s["restore_s"],
            "scheduler/num_offloads": float(s["num_offloads"]),
        }

    def close(self) -> None:
        self.client.close()


@contextmanager
def _pinned_pids(cores: list[int], pids: list[int]):
    """Executor processes (the process runtime) on the lease's cores meanwhile."""
    tids = [
        int(t)
        for pid in pids
        if os.path.isdir(f"/proc/{pid}/task")
        for t in os.listdir(f"/proc/{pid}/task")
    ]
    with pinned_threads(cores, tids):
        yield
