"""Replicas: interchangeable executors of one role (the scorers, the generators), called as one.

``Replicas(slots)`` is a sequence of the executors (handles or ``Supervised`` slots) with
each endpoint as a ``ReplicaEndpoint``, whose variants choose where the call goes:

- ``await scorers.score_groups.route(payload, then=post)``: on the least busy replica (the
  fewest calls in flight); the result;
- ``await generators.apply_weights.fanout(version)``: on every replica at once; the results,
  in the replicas' order;
- ``scorers.least_busy()``: the replica ``route`` would pick, for a caller that keeps state
  per replica (the scorer keeps each one's sandbox metrics).

The endpoint is looked up on every replica when it is first asked for, so a misspelt name
fails at once (``UnknownEndpointError``), as it does on one handle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from operator import attrgetter
from typing import Any, Generic, TypeVar

from loomrl.runtime.endpoints import Endpoint

R = TypeVar("R")
_in_flight = attrgetter("in_flight")


class Replicas(Sequence[R], Generic[R]):
    """Executors of one role, in a fixed order (a restarted one keeps its ``Supervised`` slot)."""

    def __init__(self, replicas: Iterable[R]) -> None:
        self._replicas: list[R] = list(replicas)

    def __getitem__(self, index):  # type: ignore[override]
        return self._replicas[index]

    def __len__(self) -> int:
        return len(self._replicas)

    def __iter__(self) -> Iterator[R]:
        return iter(self._replicas)

    def least_busy(self) -> R:
        """The replica with the fewest calls in flight (the first of those, on a tie)."""
        if not self._replicas:
            raise LookupError("no replicas to route a call to")
        return min(self._replicas, key=_in_flight)

    def __getattr__(self, name: str) -> ReplicaEndpoint:  # only reached for names not set yet
        if name.startswith("_"):
            raise AttributeError(name)
        for replica in self._replicas:  # (an unknown endpoint fails here, at once)
            if not isinstance(getattr(replica, name), Endpoint):
                raise AttributeError(f"{name!r} of {replica!r} is no endpoint")
        endpoint = self.__dict__[name] = ReplicaEndpoint(self, name)
        return endpoint

    def __repr__(self) -> str:
        return f"Replicas({self._replicas!r})"


class ReplicaEndpoint:
    """One endpoint over every replica: ``route`` (the least busy) or ``fanout`` (all)."""

    __slots__ = ("_replicas", "name")

    def __init__(self, replicas: Replicas, name: str) -> None:
        self._replicas, self.name = replicas, name

    def on(self, replica: Any) -> Endpoint:
        """This endpoint of one replica."""
        return getattr(replica, self.name)

    def route(
        self, *args: Any, then: Callable[[Any], Any] | None = None, **kwargs: Any
    ) -> Awaitable[Any]:
        """The call on the least busy replica (``Endpoint.call``, ``then`` and all)."""
        return self.on(self._replicas.least_busy()).call(*args, then=then, **kwargs)

    async def fanout(
        self, *args: Any, then: Callable[[Any], Any] | None = None, **kwargs: Any
    ) -> list[Any]:
        """The call on every replica at once; their results in the replicas' order (the
        first error is raised once every call has ended)."""
        calls = [self.on(r).call(*args, then=then, **kwargs) for r in self._replicas]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes
