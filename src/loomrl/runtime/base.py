"""The Runtime interface: start executors and await their methods the same way everywhere."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class CallTracker:
    """Calls that started and have not returned: ``{call id: (method, start time)}``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_id = 0
        self._running: dict[int, tuple[str, float]] = {}

    @contextmanager
    def track(self, method: str) -> Iterator[None]:
        with self._lock:
            self._next_id += 1
            call_id = self._next_id
            self._running[call_id] = (method, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                del self._running[call_id]

    def running(self) -> list[tuple[int, str, float]]:
        """``(call id, method, seconds running)`` of every unfinished call."""
        now = time.monotonic()
        with self._lock:
            return [(i, m, now - t0) for i, (m, t0) in self._running.items()]


class ExecutorHandle(ABC):
    """A started executor. ``await handle.call("method", *args)`` runs the method there."""

    name: str
    calls: CallTracker  # what is running there now (the controller's stall watchdog reads it)

    @property
    def where(self) -> str:
        """Where the executor runs, for messages (``"pid 123"``, a Ray actor id ...)."""
        return "this process"

    @abstractmethod
    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    @property
    @abstractmethod
    def busy_s(self) -> float:
        """Seconds this executor has spent running calls."""


class Runtime(ABC):
    # Executors live in the controller's process (and may share live objects with it, such
    # as one in-process weight transport); False where only pickled data reaches them.
    in_process: bool = True

    @abstractmethod
    def start(self, name: str, factory: Callable[[], Any]) -> ExecutorHandle:
        """Build an executor object with ``factory`` where it will live, and return a handle."""

    async def wait_ready(self) -> None:  # noqa: B027 - executors built in start() are ready
        """Wait until every started executor is built (a runtime may build them in the
        background, so that executors which must meet, like a torch_dist group, can)."""

    @abstractmethod
    def shutdown(self) -> None: ...
