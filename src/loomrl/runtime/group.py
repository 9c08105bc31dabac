"""Executor groups: N ranks of one executor (a sharded trainer) behind one handle.

``start_group(runtime, "trainer", rank_factory, world_size, TrainerEndpoints)`` starts
``world_size`` executors named ``trainer.rank0`` ... on any runtime (threads, processes or
Ray actors), each built by ``rank_factory(rank, world_size, rendezvous)()`` where it lives.
``rendezvous`` is ``tcp://<runtime.rendezvous_host>:<free port>``, usable as a
``torch.distributed`` ``init_method`` (rank 0 hosts it), so a rank may block in its
constructor until every rank has joined: on ``local``, whose ``start`` builds the executor
before it returns, the ranks are started together on threads; ``process`` and ``ray`` build
in the background anyway.

The handle looks like one executor to the controller and to ``Supervised``:

- a call goes to every rank with the same arguments (each rank takes its own share of a
  batch: every rank then also knows the whole batch, e.g. its token count for the loss's
  normalisation, without a collective), is awaited on all, and returns rank 0's answer;
- ``busy_s``, ``pid`` and ``where`` are rank 0's; ``alive`` holds while every rank lives;
- a rank that dies (``ExecutorDiedError``) or raises fails the whole group: the other ranks
  are killed at once (they would wait in a collective for the lost one) and the call raises
  ``ExecutorDiedError``, so supervision sees a lost trainer and the job restarts from its
  checkpoint; a rank's ``UnrecoverableError`` (a checkpoint not every node sees) is raised as
  itself, and the job stops instead; ``kill`` and ``close`` end every rank;
- ``runtime.restart(group)`` ends every rank and starts all of them again at a fresh
  rendezvous.

On ``local`` a rank cannot be killed: a group that failed there abandons its ranks' threads,
and closing it waits for a rank stuck in a collective until the rank's own process-group
timeout (which a rank should set).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from loomrl.runtime.base import ExecutorDiedError, ExecutorHandle, Runtime, UnrecoverableError
from loomrl.runtime.threads import CallTracker

logger = logging.getLogger(__name__)

# rank_factory(rank, world_size, rendezvous) -> the zero-argument factory of that rank (it
# must pickle on ``process`` and ``ray``: a module-level function or a functools.partial of one)
RankFactory = Callable[[int, int, str], Callable[[], Any]]


def rank_name(name: str, rank: int) -> str:
    """``("trainer", 1)`` -> ``"trainer.rank1"``: the executor name of one rank (its role is the group's)."""
    return f"{name}.rank{rank}"


# Ray's worker ports (its default min/max_worker_port) sit below this: a rendezvous above it
# and below the kernel's ephemeral range meets neither.
_LISTEN_PORTS_FROM = 20000


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out as a connection's source port (Linux), else 32768."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bind(sock: socket.socket, host: str, port: int) -> None:
    try:
        sock.bind((host, port))
    # another node's address (a cluster's trainer node): free here, likely there
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise
        sock.bind(("", port))


def free_port(host: str, tries: int = 64) -> int:
    """A TCP port free on this host now (on ``host``'s address where it is one of this host's).

    Drawn below the kernel's ephemeral range: a port from ``bind(0)`` is one of those, and
    between this check and the listen of the rank that hosts the rendezvous any outgoing
    connection on the machine (Ray opens many) may take it as its source port (EADDRINUSE
    in ``init_process_group``). Falls back to ``bind(0)`` where no such range is left."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(tries if low - _LISTEN_PORTS_FROM >= 1000 else 0):
        port = rng.randrange(_LISTEN_PORTS_FROM, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                _bind(sock, host, port)
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        _bind(sock, host, 0)
        return sock.getsockname()[1]


def new_rendezvous(host: str) -> str:
    """``tcp://host:port`` at a free port: where the ranks of one start meet."""
    return f"tcp://{host}:{free_port(host)}"


def start_group(
    runtime: Runtime,
    name: str,
    rank_factory: RankFactory,
    world_size: int,
    interface: type | None = None,
) -> ExecutorGroup:
    """Start ``world_size`` ranks of executor ``name`` on ``runtime``, meeting at a fresh
    rendezvous, and return one handle for all of them (module docstring)."""
    if world_size < 1:
        raise ValueError(f"an executor group needs world_size >= 1, got {world_size}")
    rendezvous = new_rendezvous(runtime.rendezvous_host)
    factories = [rank_factory(rank, world_size, rendezvous) for rank in range(world_size)]
    names = [rank_name(name, rank) for rank in range(world_size)]
    if runtime.in_process:  # ``start`` builds the rank before it returns: start them together
        ranks = _start_together(runtime, names, factories, interface)
    else:  # they build in the background (wait_ready / ready): started one after the other
        ranks = []
        try:
            for rank_executor, factory in zip(names, factories, strict=True):
                ranks.append(runtime.start(rank_executor, factory, interface))
        except BaseException:
            _end_quietly(ranks, runtime)
            raise
    logger.info("started executor group %r: %d ranks meeting at %s", name, world_size, rendezvous)
    return ExecutorGroup(name, ranks, rank_factory, interface, rendezvous)


def _start_together(
    runtime: Runtime, names: list[str], factories: list[Callable[[], Any]], interface: type | None
) -> list[ExecutorHandle]:
    """Each rank's ``start`` on a thread of its own, so that ranks that wait for each other
    in their constructors can meet; a rank that failed ends those that started."""
    with ThreadPoolExecutor(len(names), thread_name_prefix="loomrl-group-start") as pool:
        futures = {
            pool.submit(runtime.start, n, f, interface): n
            for n, f in zip(names, factories, strict=True)
        }
        # the first rank to fail is the cause (the others then time out waiting for it)
        failed = next(
            ((futures[f], f.exception()) for f in as_completed(futures) if f.exception()), None
        )
    started = [f.result() for f in futures if f.exception() is None]
    if failed is not None:
        _end_quietly(started, runtime)
        name, error = failed
        error.add_note(f"raised while starting {name!r} of an executor group of {len(names)}")
        raise error
    for rank in started:  # (appended as each finished its start: keep them in rank order)
        runtime.handles.remove(rank)
    runtime.handles.extend(started)
    return started


def _end_quietly(ranks: list[ExecutorHandle], runtime: Runtime | None = None) -> None:
    """End ``ranks`` (killed where the runtime can, then closed) and forget them."""
    for rank in ranks:
        try:
            rank.kill()
        except NotImplementedError:  # a thread: closing waits for its running call, if any
            pass
        except Exception as err:  # noqa: BLE001 - it is being ended either way
            logger.warning("killing %r failed: %s", rank.name, err)
    with ThreadPoolExecutor(max(1, len(ranks)), thread_name_prefix="loomrl-group-close") as pool:
        list(pool.map(_close_quietly, ranks))
    for rank in ranks:
        if runtime is not None and rank in runtime.handles:
            runtime.handles.remove(rank)


def _close_quietly(rank: ExecutorHandle) -> None:
    try:
        rank.close()
    except Exception as err:  # noqa: BLE001 - the others are closed all the same
        logger.warning("executor %r did not close cleanly: %s", rank.name, err)


class ExecutorGroup(ExecutorHandle):
    """N ranks behind one handle (module docstring). ``ranks[i]`` is rank ``i``'s own handle."""

    def __init__(
        self,
        name: str,
        ranks: list[ExecutorHandle],
        rank_factory: RankFactory,
        interface: type | None,
        rendezvous: str,
    ) -> None:
        self.name, self.ranks, self.rank_factory = name, ranks, rank_factory
        self.rendezvous = rendezvous
        self.calls = CallTracker(self.name)
        self._dead: ExecutorDiedError | None = None
        self._closed = False
        self._bind_interface(interface)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    async def _invoke(self, method: str, args: tuple, kwargs: dict) -> Any:
        if self._dead is not None:
            raise self._dead
        with self.calls.track(method):
            calls = [
                asyncio.ensure_future(rank.submit(method, args, kwargs)) for rank in self.ranks
            ]
            try:
                await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
            # the caller gave up: the ranks' calls run on (as with one executor)
            except asyncio.CancelledError:
                for call in calls:
                    call.add_done_callback(_retrieve)
                raise
            failed = next(
                (i for i, call in enumerate(calls) if call.done() and _failure(call) is not None),
                None,
            )
            if failed is None:
                return calls[0].result()
            for call in calls:
                call.add_done_callback(_retrieve)  # the others fail once their ranks are killed
            cause = _failure(calls[failed])
            lost = await self._fail(failed, f"its {method!r} call failed", cause)
            raise cause if isinstance(cause, UnrecoverableError) else lost

    def _submit(
        self,
        method: str,
        args: tuple,
        kwargs: dict,
        on_done: Callable[[], None] | None = None,
        post: Callable[[Any], Any] | None = None,
    ) -> asyncio.Future:
        """A call as a task, its failure marked as seen: ``_fail`` logged it, and a caller that
        left (``Supervised`` after a deadline kill) would have it logged again at garbage
        collection, in whatever code runs then."""
        future = super()._submit(method, args, kwargs, on_done, post)
        future.add_done_callback(_retrieve)
        return future

    async def _fail(self, rank: int, what: str, cause: BaseException) -> ExecutorDiedError:
        """The group is lost: end every rank (off the loop: a kill may wait for the process)."""
        where = self.ranks[rank].where
        error = ExecutorDiedError(
            f"executor group {self.name!r}: rank {rank} of {self.world_size} ({where}) {what}: "
            f"{type(cause).__name__}: {cause}; the group's other ranks were killed"
        )
        error.__cause__ = cause
        if self._dead is None:
            self._dead = error
            logger.error("%s", error)
            await asyncio.to_thread(self._kill_ranks)
        return error

    def _kill_ranks(self) -> list[str]:
        """Kill every rank that can be killed; the names of those that cannot (threads)."""
        unkillable = []
        for rank in self.ranks:
            try:
                rank.kill()
            except NotImplementedError:
                unkillable.append(rank.name)
            except Exception as err:  # noqa: BLE001 - the group is ended either way
                logger.warning("killing %r failed: %s", rank.name, err)
        return unkillable

    async def ready(self) -> None:
        """Wait until every rank is built; a rank that failed to build ends the others and
        its error is raised (as itself, naming the rank)."""
        waits = [asyncio.ensure_future(rank.ready()) for rank in self.ranks]
        await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
        failed = next(
            (i for i, wait in enumerate(waits) if wait.done() and _failure(wait) is not None), None
        )
        if failed is None:
            return
        for wait in waits:
            wait.add_done_callback(_retrieve)
        cause = _failure(waits[failed])
        await self._fail(failed, "did not start", cause)
        cause.add_note(
            f"rank {failed} of executor group {self.name!r} did not start; the other ranks were killed"
        )
        raise cause

    @property
    def busy_s(self) -> float:
        return self.ranks[0].busy_s

    @property
    def where(self) -> str:
        return f"{self.ranks[0].where}, rank 0 of {self.world_size}"

    @property
    def pid(self) -> int | None:
        return self.ranks[0].pid

    @property
    def alive(self) -> bool:
        return self._dead is None and all(rank.alive for rank in self.ranks)

    def kill(self) -> None:
        """Kill every rank; ``NotImplementedError`` (after killing those it could) where
        ranks are threads."""
        if self._dead is None:
            self._dead = ExecutorDiedError(f"executor group {self.name!r} was killed")
        unkillable = self._kill_ranks()
        if unkillable:
            raise NotImplementedError(
                f"cannot kill executor group {self.name!r}'s ranks {', '.join(unkillable)}"
            )

    def close(self) -> None:
        """Close every rank (together: a rank's ``close`` may wait for the others); a group
        that failed kills its ranks first, so none is asked while stuck in a collective."""
        if self._closed:
            return
        self._closed = True
        if self._dead is not None:
            self._kill_ranks()
        else:
            self._dead = ExecutorDiedError(f"executor group {self.name!r} was closed")
        with ThreadPoolExecutor(
            self.world_size, thread_name_prefix=f"loomrl-{self.name}-close"
        ) as pool:
            list(pool.map(_close_quietly, self.ranks))

    def starter(self, runtime: Runtime) -> Callable[[], ExecutorGroup]:
        """Start every rank again, at a fresh rendezvous (``Runtime.restart``)."""

        def start_again() -> ExecutorGroup:
            for rank in self.ranks:  # (ended by now)
                if rank in runtime.handles:
                    runtime.handles.remove(rank)
            return start_group(
                runtime, self.name, self.rank_factory, self.world_size, self.interface
            )

        return start_again


def _failure(future: asyncio.Future) -> BaseException | None:
    """What a done call raised (a call its handle dropped: ``CancelledError``), else None."""
    if future.cancelled():
        return asyncio.CancelledError("the rank's handle dropped the call")
    return future.exception()


def _retrieve(future: asyncio.Future) -> None:
    """Mark a rank call's outcome as seen (the group already failed, or its caller left)."""
    if not future.cancelled():
        future.exception()
