"""The Runtime interface: start executors and await their methods the same way everywhere.

What callers see: ``Runtime`` (start, restart, shut down executors), ``ExecutorHandle`` (a
started executor's endpoints) and the errors every runtime raises. The threads that run the
calls are in ``loomrl.runtime.threads``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from loomrl.runtime.endpoints import (
    Endpoint,
    bind_arguments,
    check_no_then_parameter,
    endpoints_of,
    unknown_endpoint,
)
from loomrl.runtime.threads import CallTracker

logger = logging.getLogger(__name__)


async def _posted(call: Awaitable[Any], post: Callable[[Any], Any]) -> Any:
    return post(await call)


def then(future: asyncio.Future, on_done: Callable[[], None] | None) -> asyncio.Future:
    """``future``, with ``on_done()`` run when it is done (if given)."""
    if on_done is not None:
        future.add_done_callback(lambda _: on_done())
    return future


class UnknownEndpointError(AttributeError):
    """A handle was asked for a method its interface does not declare."""


class RemoteError(RuntimeError):
    """An executor raised an exception that could not be sent back as itself."""


def role_of(name: str) -> str:
    """``generator1`` -> ``generator``, ``trainer.rank1`` -> ``trainer`` (a rank of an executor
    group, ``loomrl.runtime.group``): executors of one role share resources, deadlines and counts."""
    return name.partition(".")[0].rstrip("0123456789")


class ExecutorDiedError(RuntimeError):
    """The executor ended (its process killed, out of memory, its node lost, or killed
    after a missed deadline) while the controller still needed it; every runtime raises
    this one error, so the controller's supervision does not depend on the runtime."""


class UnrecoverableError(RuntimeError):
    """An executor's error that no restart cures (a checkpoint folder the trainer's nodes do
    not all see, a broken config): an executor group one of whose ranks raises it is ended
    all the same, but its call raises this error itself, not ``ExecutorDiedError``, so the job
    stops at once instead of restarting from its checkpoint into the same error."""


class ExecutorHungError(ExecutorDiedError):
    """An executor call ran past its deadline; the executor was killed."""


class ExecutorHandle(ABC):
    """A started executor. Started against an interface (``Generator``, ``TrainerEndpoints``),
    the handle has one ``Endpoint`` per endpoint: ``await trainer.train_step(groups)``,
    ``await generator.generate.call(requests, then=post)``; any other name fails at once with
    ``UnknownEndpointError``. ``await handle.call("method", ...)`` is the same call by name,
    for an executor started without an interface (tests, tools)."""

    name: str
    calls: CallTracker  # what is running there now (the controller's stall watchdog reads it)
    interface: type | None = None
    factory: Callable[[], Any] | None = None  # what built the executor (a restart builds it again)
    # Whether a lost executor is started again in its place: a bare handle is not, a
    # supervised slot (``loomrl.runtime.supervision.Supervised``) with a runtime is
    restartable: bool = False

    def _bind_interface(self, interface: type | None) -> None:
        """Give this handle the interface's endpoints as ``Endpoint`` attributes."""
        self.interface = interface
        if interface is None:
            return
        check_no_then_parameter(interface)
        for endpoint_name in endpoints_of(interface):
            if hasattr(type(self), endpoint_name):
                raise TypeError(
                    f"endpoint {interface.__name__}.{endpoint_name} clashes with the handle's own attribute"
                )
            setattr(self, endpoint_name, Endpoint(endpoint_name, self._send))

    async def _send(
        self, method: str, args: tuple, kwargs: dict, post: Callable[[Any], Any] | None
    ) -> Any:
        """An ``Endpoint``'s call: arguments checked here, the call run there."""
        bind_arguments(self.interface, method, args, kwargs)
        return await self._submit(method, args, kwargs, None, post)

    def __getattr__(self, name: str) -> Any:  # only reached for names the handle lacks
        interface = self.__dict__.get("interface")
        if interface is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")
        raise UnknownEndpointError(str(unknown_endpoint(interface, name)))

    @property
    def where(self) -> str:
        """Where the executor runs, for messages (``"pid 123"``, a Ray actor id ...)."""
        return "this process"

    @property
    def pid(self) -> int | None:
        """The process the executor runs in, on this host (None if elsewhere)."""
        return os.getpid()

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` there by name; checked against the interface, if any."""
        self._check(method, args, kwargs)
        return await self._invoke(method, args, kwargs)

    @property
    def in_flight(self) -> int:
        """Calls running there now (``Replicas.least_busy`` routes by it)."""
        return len(self.calls.running())

    def submit(
        self,
        method: str,
        args: tuple,
        kwargs: dict,
        on_done: Callable[[], None] | None = None,
        post: Callable[[Any], Any] | None = None,
    ) -> asyncio.Future:
        """``call`` as a future (checked the same way, at once), for a caller that watches
        the call rather than awaits it (``Supervised``): on runtimes whose calls already
        are futures (threads, processes), no task is made to run it. ``on_done()`` runs on
        the loop when the call ends, just after the future is resolved (on ``process`` in
        the same callback: no turn of the loop of its own).

        ``post``: the future resolves with ``post(result)`` instead, run where the call
        ended (``Endpoint.call``'s ``then``)."""
        self._check(method, args, kwargs)
        return self._submit(method, args, kwargs, on_done, post)

    def _check(self, method: str, args: tuple, kwargs: dict) -> None:
        if self.interface is not None:
            if method not in endpoints_of(self.interface):
                raise UnknownEndpointError(str(unknown_endpoint(self.interface, method)))
            bind_arguments(self.interface, method, args, kwargs)

    @abstractmethod
    async def _invoke(self, method: str, args: tuple, kwargs: dict) -> Any:
        """Run ``method(*args, **kwargs)`` on the executor and return its result."""

    def _submit(
        self,
        method: str,
        args: tuple,
        kwargs: dict,
        on_done: Callable[[], None] | None = None,
        post: Callable[[Any], Any] | None = None,
    ) -> asyncio.Future:
        """``_invoke`` as a future (with ``post`` on the loop); a runtime whose calls are
        futures returns them as they are."""
        call = self._invoke(method, args, kwargs)
        return then(asyncio.ensure_future(call if post is None else _posted(call, post)), on_done)

    @property
    @abstractmethod
    def busy_s(self) -> float:
        """Seconds this executor has spent running calls."""

    async def ready(self) -> None:  # noqa: B027 - built in start(): ready at once
        """Wait until the executor is built (its model loaded); raises if building failed."""

    @property
    def alive(self) -> bool:
        """False once the executor is known to be gone (died, killed or closed)."""
        return True

    def kill(self) -> None:
        """End the executor now, without asking it (a hung one would not answer): its
        pending and later calls fail with ``ExecutorDiedError``. Runtimes that cannot (a
        thread cannot be killed) raise ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} cannot kill its executor")

    def close(self) -> None:  # noqa: B027 - a handle with nothing to release
        """Let the executor release what it holds, then end it."""

    def starter(self, runtime: Runtime) -> Callable[[], ExecutorHandle]:
        """What starts this executor again on ``runtime`` (``Runtime.restart`` calls it once
        the old one is ended): its factory, under its name and interface. (An executor group
        starts all its ranks again, at a fresh rendezvous.)"""
        if self.factory is None:
            raise RuntimeError(
                f"executor {self.name!r} was started without a factory; it cannot be restarted"
            )
        return partial(runtime.start, self.name, self.factory, self.interface)


class Runtime(ABC):
    # Executors live in the controller's process (and may share live objects with it, such
    # as one in-process weight transport); False where only pickled data reaches them.
    in_process: bool = True
    # Where executors that must meet (a torch_dist group) find the trainer, which hosts the
    # rendezvous: loopback on one host; a runtime across nodes sets the trainer node's address.
    rendezvous_host: str = "127.0.0.1"

    @abstractmethod
    def start(
        self, name: str, factory: Callable[[], Any], interface: type | None = None
    ) -> ExecutorHandle:
        """Build an executor object with ``factory`` where it will live, and return a handle
        with the endpoints of ``interface``; an object that lacks one of them fails the start
        (``MissingEndpointError``, here or from ``wait_ready``)."""

    def uses_transport(self, kind: str, kwargs: dict[str, Any]) -> None:  # noqa: B027
        """Told the job's weight transport (``transport_args``) before its executors start;
        a runtime that places them on several nodes checks it against where they landed."""

    async def wait_ready(self) -> None:  # noqa: B027 - executors built in start() are ready
        """Wait until every started executor is built (a runtime may build them in the
        background, so that executors which must meet, like a torch_dist group, can)."""

    handles: list[ExecutorHandle]

    def restart(self, handle: ExecutorHandle) -> ExecutorHandle:
        """Replace ``handle``'s executor by a fresh one built by the same factory, against
        the same interface, under the same name (an executor group: all its ranks, at a fresh
        rendezvous): the old one is killed first (if it still runs) so that it cannot answer
        late. The fresh executor holds none of the old one's state; the caller brings it up to
        date (weights, for a generator)."""
        # (one started without a factory fails here, before it is ended)
        start = handle.starter(self)
        ended = True
        if handle.alive:
            try:
                handle.kill()
            except NotImplementedError:  # (a thread): closing would wait on its hung call
                ended = False
                logger.warning(
                    "%s cannot kill executor %r; it is abandoned, not ended",
                    type(self).__name__,
                    handle.name,
                )
        try:
            if ended:
                handle.close()
        except Exception as err:  # noqa: BLE001 - the old executor is gone either way
            logger.warning("executor %r did not close after its kill: %s", handle.name, err)
        if handle in self.handles:
            self.handles.remove(handle)
        return start()

    @abstractmethod
    def shutdown(self) -> None: ...


def peak_rss_mb(pid: int | None) -> float | None:
    """The peak resident memory of process ``pid`` so far, in MiB (Linux ``VmHWM``); None
    where it cannot be read."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
