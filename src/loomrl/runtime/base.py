"""The Runtime interface: start executors and await their methods the same way everywhere."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any


class ExecutorHandle(ABC):
    """A started executor. ``await handle.call("method", *args)`` runs the method there."""

    name: str

    @abstractmethod
    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    @property
    @abstractmethod
    def busy_s(self) -> float:
        """Seconds this executor has spent running calls."""


class Runtime(ABC):
    @abstractmethod
    def start(self, name: str, factory: Callable[[], Any]) -> ExecutorHandle:
        """Build an executor object with ``factory`` where it will live, and return a handle."""

    async def wait_ready(self) -> None:  # noqa: B027 - executors built in start() are ready
        """Wait until every started executor is built (a runtime may build them in the
        background, so that executors which must meet, like a torch_dist group, can)."""

    @abstractmethod
    def shutdown(self) -> None: ...
