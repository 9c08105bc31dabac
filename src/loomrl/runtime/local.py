"""The ``local`` runtime: every executor lives in its own thread of this process.

Each executor thread runs one call at a time, so calls to one executor are serialized
(a weight update queued behind a generate call runs between requests) while different
executors run in parallel. Endpoints the executor declares ``concurrent`` run on a pool of
their own, so their calls may overlap (an engine that batches continuously). Torch is limited to one intra-op thread per process, so a
generator and a trainer each keep one core busy.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from loomrl.runtime.base import ExecutorHandle, Runtime
from loomrl.runtime.endpoints import MissingEndpointError, check_implements
from loomrl.runtime.threads import BusyClock, CallTracker, WorkerThreads, on_thread

CONCURRENT_WORKERS = 16  # threads for the endpoints an executor declares concurrent


class LocalHandle(ExecutorHandle):
    def __init__(
        self, name: str, factory: Callable[[], Any], interface: type | None = None
    ) -> None:
        self.name, self.factory = name, factory
        self._pool = WorkerThreads(f"loomrl-{name}")
        self._concurrent_pool: WorkerThreads | None = None
        self._busy = BusyClock()
        self.calls = CallTracker(self.name)
        self.obj = self._pool.submit(factory).result()
        self.concurrent: dict[str, bool] = {}
        if interface is not None:
            try:
                self.concurrent = check_implements(self.obj, interface)
            except MissingEndpointError:
                self.close()
                raise
        self._bind_interface(interface)

    def _pool_for(self, method: str) -> WorkerThreads:
        if not self.concurrent.get(method):
            return self._pool
        if self._concurrent_pool is None:
            self._concurrent_pool = WorkerThreads(f"loomrl-{self.name}-c", CONCURRENT_WORKERS)
        return self._concurrent_pool

    def _timed(self, method: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        t0 = time.perf_counter()
        try:
            with self.calls.track(method):
                return fn(*args, **kwargs)
        finally:
            self._busy.add(time.perf_counter() - t0)

    async def _invoke(self, method: str, args: tuple, kwargs: dict) -> Any:
        return await self._submit(method, args, kwargs)

    def _submit(
        self,
        method: str,
        args: tuple,
        kwargs: dict,
        on_done: Callable[[], None] | None = None,
        post: Callable[[Any], Any] | None = None,
    ) -> asyncio.Future:
        fn = getattr(self.obj, method)  # (``post`` runs after the call's busy time, on its thread)
        return on_thread(
            asyncio.get_running_loop(),
            self._pool_for(method),
            on_done,
            self._timed,
            method,
            fn,
            args,
            kwargs,
            skip_cancelled=True,
            post=post,
        )

    @property
    def where(self) -> str:
        return f"a thread of pid {os.getpid()}"

    @property
    def busy_s(self) -> float:
        return self._busy.seconds

    def close(self) -> None:
        """Let the executor release what it holds (its ``close()``), then end its thread."""
        closer = getattr(self.obj, "close", None)
        if callable(closer):  # first: it may end calls still running (a scorer cancels its batches)
            self._pool.submit(closer).result()
        if self._concurrent_pool is not None:
            self._concurrent_pool.shutdown(wait=True, cancel_futures=True)
        self._pool.shutdown(wait=True, cancel_futures=True)


class LocalRuntime(Runtime):
    def __init__(self, torch_threads: int = 1) -> None:
        # lazy: torch loads when this runs, not with the module
        import torch

        torch.set_num_threads(torch_threads)
        self.handles: list[LocalHandle] = []

    def start(
        self, name: str, factory: Callable[[], Any], interface: type | None = None
    ) -> LocalHandle:
        handle = LocalHandle(name, factory, interface)
        self.handles.append(handle)
        return handle

    def shutdown(self) -> None:
        for handle in self.handles:
            handle.close()
        self.handles.clear()
