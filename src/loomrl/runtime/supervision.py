"""Self-healing executors, the same on every runtime.

The controller calls generators, scorers and the trainer through a ``Supervised`` slot
instead of the bare handle. Each call runs under a deadline derived from the calls of that
method seen so far (``faults.deadline_factor`` times the longest, never under
``faults.min_deadline_s``; ``faults.first_call_deadline_s`` until ``faults.deadline_calls``
calls have been seen, since a first call also waits for the model to load). When the
executor dies (``ExecutorDiedError``: process killed, out of memory, node lost) or its call
runs past the deadline (then it is killed first, so it can never answer late), the slot:

- counts the failure (``executor/<role>_failures``, ``executor/hung_kills``);
- if the role may restart, builds a fresh executor with the runtime (same factory, same
  name), runs ``on_restart`` on it (a generator first gets a full weight update of the
  current version, never a delta on a base it lacks) and counts the restart;
- raises ``ExecutorLostError`` to the caller, whose work was lost: the caller hands it out
  again exactly once (prompts back to the stream, rollouts to another scorer).

Calls that failed together (several in flight on one executor) restart it once. The
trainer's slot does not restart in place (its optimizer state is gone): its loss raises
``TrainerLostError`` and the job restarts from its last checkpoint (``faults.max_restarts``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import Any

from loomrl.runtime.base import (
    ExecutorDiedError,
    ExecutorHandle,
    ExecutorHungError,
    Runtime,
    UnknownEndpointError,
    role_of,
)
from loomrl.runtime.endpoints import Endpoint, endpoints_of, unknown_endpoint

logger = logging.getLogger(__name__)


class ExecutorLostError(RuntimeError):
    """A call's executor died or hung: the call's work is lost (and the executor was
    replaced, if its role restarts). The caller re-queues the work."""

    def __init__(self, message: str, role: str, restarted: bool) -> None:
        super().__init__(message)
        self.role, self.restarted = role, restarted


class TrainerLostError(ExecutorLostError):
    """The trainer died or hung; the job restarts from its last checkpoint (or fails)."""


def was_replaced(err: BaseException) -> bool:
    """Whether ``err`` says a call's executor was lost and replaced by a fresh one, which
    holds none of the old one's state (what a layer that moves state, such as
    ``loomrl.device.colocate``, is given to tell a lost executor from a failed move)."""
    return isinstance(err, ExecutorLostError) and err.restarted


class RestartLimitError(RuntimeError):
    """More executors died than ``faults.max_executor_restarts`` allows in one run."""


# Checkpoint I/O grows with the model and the disk, and runs rarely: no kill deadline (the
# stall watchdog still warns about it).
NO_DEADLINE = frozenset({"save_checkpoint", "save_pretrained", "load_state_dict", "state_dict"})


class Deadlines:
    """Per ``(role, method, batch-size bucket)`` deadlines from the running times of the
    calls seen so far (``call_key``)."""

    def __init__(
        self, factor: float = 10.0, min_s: float = 60.0, first_s: float = 900.0, calls: int = 3
    ) -> None:
        self.factor, self.min_s, self.first_s, self.calls = factor, min_s, first_s, calls
        self._longest: dict[tuple, float] = {}
        self._count: Counter[tuple] = Counter()

    @classmethod
    def from_config(cls, faults) -> Deadlines:
        return cls(
            faults.deadline_factor,
            faults.min_deadline_s,
            faults.first_call_deadline_s,
            faults.deadline_calls,
        )

    def limit(self, role: str, call: str | tuple[str, int]) -> float | None:
        """Seconds a call may run; None for checkpoint I/O (``NO_DEADLINE``)."""
        if (call if isinstance(call, str) else call[0]) in NO_DEADLINE:
            return None
        key = (role, call)
        if self._count[key] < self.calls:
            return max(self.first_s, self.min_s)
        return max(self.min_s, self.factor * self._longest[key])

    def observe(self, role: str, call: str | tuple[str, int], seconds: float) -> None:
        key = (role, call)
        self._count[key] += 1
        self._longest[key] = max(self._longest.get(key, 0.0), seconds)


class FaultStats:
    """Every executor failure, restart and re-queue of a run, for the metrics."""

    def __init__(self, max_executor_restarts: int = 10) -> None:
        self.max_executor_restarts = max_executor_restarts
        self.failures: Counter[str] = Counter()  # by role
        self.restarts: Counter[str] = Counter()  # by role
        self.hung_kills = 0
        self.requeued_prompts = 0  # prompts handed out again after their generate call was lost
        # rollouts sent to a scorer again after their score call was lost
        self.rescored_rollouts = 0
        self.lost_rollouts = 0  # rollouts whose second score call was lost too (counted as failed)
        self.trainer_restarts = 0  # job restarts from a checkpoint (set by the session)
        self.last_error: str | None = None
        self._metrics_key: tuple | None = None
        self._metrics: dict[str, float] = {}

    @property
    def total_restarts(self) -> int:
        return sum(self.restarts.values())

    def metrics(self) -> dict[str, float]:
        """The counts as metrics (a copy: built again only when a count changed, which
        is rare, so the step record costs one tuple comparison)."""
        key = (
            self.hung_kills,
            self.requeued_prompts,
            self.rescored_rollouts,
            self.lost_rollouts,
            self.trainer_restarts,
            tuple(self.failures.items()),
            tuple(self.restarts.items()),
        )
        if key != self._metrics_key:
            self._metrics_key, self._metrics = key, self._build_metrics()
        return dict(self._metrics)

    def _build_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            "executor/restarts": self.total_restarts,
            "executor/hung_kills": self.hung_kills,
            "executor/requeued_prompts": self.requeued_prompts,
            "executor/rescored_rollouts": self.rescored_rollouts,
            "executor/lost_rollouts": self.lost_rollouts,
            "executor/trainer_restarts": self.trainer_restarts,
        }
        for role in ("generator", "scorer", "trainer", "weight_group", *self.failures):
            out[f"executor/{role}_failures"] = self.failures[role]
        for role in ("generator", "scorer", *self.restarts):
            out[f"executor/{role}_restarts"] = self.restarts[role]
        return out


class Supervised:
    """One executor as the controller sees it: ``await slot.generate(requests)`` (and every
    variant of ``Endpoint``) calls the current handle under a deadline and heals the executor when the call is lost (module
    docstring). Everything else (``name``, ``calls``, ``where``, ``pid``) is the current
    handle's; ``busy_s`` adds up the executor's incarnations."""

    # how often one check per executor looks whether its running call is past its deadline
    check_s = 0.5

    def __init__(
        self,
        runtime: Runtime | None,
        handle: ExecutorHandle,
        deadlines: Deadlines | None,
        stats: FaultStats,
        *,
        restart: bool = True,
        on_restart: Callable[[Supervised], Awaitable[None]] | None = None,
    ) -> None:
        self.runtime, self.handle = runtime, handle
        self.role = role_of(handle.name)
        self.deadlines, self.stats = deadlines, stats
        self.restartable = restart and runtime is not None
        self.on_restart = on_restart
        self.incarnation = 0  # grows with each restart
        self._counted = -1  # the incarnation whose loss is counted (a cancelled heal may rerun)
        self._busy_before = 0.0
        self._heal_lock = asyncio.Lock()
        self.in_flight = 0  # calls running now (the scorer pool balances on it)
        self.lost: ExecutorLostError | None = None  # a role that does not restart: what lost it
        self._queue: deque[_Queued] = deque()  # calls submitted and not returned, in order
        self._serving = asyncio.Event()
        self._serving.set()
        # The loop a deadline check is armed on (checks run every check_s while calls are queued);
        # a loop, not a flag, so a check left armed on a closed loop does not stop later ones.
        self._deadline_loop: asyncio.AbstractEventLoop | None = None
        self._bind_endpoints()

    # -- what the controller reads off a handle
    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def calls(self):
        return self.handle.calls

    @property
    def where(self) -> str:
        return self.handle.where

    @property
    def pid(self) -> int | None:
        return self.handle.pid

    @property
    def busy_s(self) -> float:
        return self._busy_before + self.handle.busy_s

    def _bind_endpoints(self) -> None:
        """The handle's endpoints as this slot's own ``Endpoint`` attributes, called through
        the slot (an executor started without an interface gets one per name asked for)."""
        interface = self.handle.interface
        if interface is not None:
            for name in endpoints_of(interface):
                self.__dict__[name] = Endpoint(name, self._send)

    def __getattr__(self, method: str) -> Endpoint:  # only reached for names the slot lacks
        interface = self.__dict__.get("handle") and self.handle.interface
        if method.startswith("_") or interface:
            if interface and not method.startswith("_"):
                raise UnknownEndpointError(str(unknown_endpoint(interface, method)))
            raise AttributeError(method)
        self.__dict__[method] = Endpoint(method, self._send)  # (no interface: any name)
        return self.__dict__[method]

    def call(self, method: str, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        """``method(*args, **kwargs)`` on the executor by name, watched and healed (to await)."""
        return self._send(method, args, kwargs, None)

    async def _send(
        self, method: str, args: tuple, kwargs: dict, post: Callable[[Any], Any] | None
    ) -> Any:
        """An ``Endpoint``'s call through the slot, resolving with ``post(result)`` run where
        the call ended, off the controller's loop (``Endpoint.call``); ``post`` None: the
        result itself."""
        if not self._serving.is_set():  # a restart in progress: calls wait for the fresh executor
            await self._serving.wait()
        if self.lost is not None:  # counted once, when it was lost
            raise type(self.lost)(str(self.lost), self.role, restarted=False)
        handle, incarnation = self.handle, self.incarnation
        self.in_flight += 1
        try:
            # (an in-process runtime: nothing to kill, nothing to restart)
            if self.deadlines is None:
                # (the handle's future itself: no coroutine frame of the handle's a call)
                return await handle.submit(method, args, kwargs, None, post)
            return await self._call_with_deadline(handle, incarnation, method, args, kwargs, post)
        finally:
            self.in_flight -= 1

    async def _call_with_deadline(
        self,
        handle: ExecutorHandle,
        incarnation: int,
        method: str,
        args: tuple,
        kwargs: dict,
        post: Callable[[Any], Any] | None = None,
    ) -> Any:
        """The call, watched: it is hung when it has *run* (not waited behind the calls
        before it: an executor runs its calls one at a time, in order) past its deadline."""
        key = call_key(method, args)
        loop = asyncio.get_running_loop()
        call = _Queued(key, self.deadlines.limit(self.role, key), loop.create_future())
        if not self._queue:
            call.started = time.monotonic()
        self._queue.append(call)
        try:
            # a future: no task of its own
            inner = handle.submit(method, args, kwargs, lambda: self._finished(call), post)
        except BaseException:
            self._finished(call)
            raise
        # one timer per executor while it has calls, not one per call
        if self._deadline_loop is not loop:
            self._deadline_loop = loop
            loop.call_later(self.check_s, self._check_deadline)
        await self._wait(handle, incarnation, call, inner)
        try:
            result = inner.result()
        except ExecutorDiedError as err:
            await self._heal(handle, incarnation, err, hung=False)
        except asyncio.CancelledError as err:  # not this caller's cancel: the handle dropped it
            dropped = f"executor {handle.name!r}: call {method!r} was dropped by its handle"
            await self._heal(handle, incarnation, ExecutorDiedError(dropped), hung=False)
            raise AssertionError("unreachable") from err
        self.deadlines.observe(self.role, key, call.ran_s)
        return result

    async def _wait(
        self, handle: ExecutorHandle, incarnation: int, call: _Queued, inner: asyncio.Future
    ) -> None:
        """Until the call ends; a call past its deadline is healed (killed, replaced) and
        raises ``ExecutorLostError`` here."""
        while True:
            # Woken by the call's end or by the deadline check; a cancelled caller cancels only
            # its wake-up, and the call runs on.
            hung = await call.woken
            if hung is None or inner.done():
                return
            call.woken = asyncio.get_running_loop().create_future()  # (if another call heals first)
            # this caller leaves without the call's result: its ExecutorDiedError, once the kill
            # lands, is taken here, not logged at GC ("Future exception was never retrieved",
            # whose traceback CPython 3.11 can fail to format there: an AST SystemError)
            inner.add_done_callback(_take_outcome)
            if self.incarnation == incarnation:
                await self._heal(
                    handle,
                    incarnation,
                    ExecutorHungError(
                        f"executor {handle.name!r} ({handle.where}): a {hung.key[0]!r} call ran past its deadline of "
                        f"{hung.limit:.1f} s (faults.deadline_factor x the longest such call so far); killed"
                    ),
                    hung=True,
                )

    def _finished(self, call: _Queued) -> None:
        """A call returned (or failed): the next one in the executor's queue starts now."""
        now = time.monotonic()
        call.ran_s = now - (call.started or now)
        if call in self._queue:
            self._queue.remove(call)
        if self._queue and self._queue[0].started is None:
            self._queue[0].started = now
        if not call.woken.done():
            call.woken.set_result(None)

    def _check_deadline(self) -> None:
        """Every ``check_s`` while calls are queued: a running call past its deadline wakes
        every caller waiting on this executor (each heals it, or finds it healed)."""
        self._deadline_loop = None
        hung = self._hung_head()
        if hung is not None:
            for call in self._queue:
                if not call.woken.done():
                    call.woken.set_result(hung)
        if self._queue:
            self._deadline_loop = asyncio.get_running_loop()
            self._deadline_loop.call_later(self.check_s, self._check_deadline)

    def _hung_head(self) -> _Queued | None:
        """The running call, if it has run past its deadline."""
        if not self._queue:
            return None
        head = self._queue[0]
        if head.limit is None or head.started is None:
            return None
        return head if time.monotonic() - head.started > head.limit else None

    async def _heal(
        self, handle: ExecutorHandle, incarnation: int, cause: BaseException, hung: bool
    ) -> None:
        """Count the loss, replace the executor (once for all the calls lost with it) and
        raise ``ExecutorLostError`` (``TrainerLostError`` for the trainer)."""
        error = TrainerLostError if self.role == "trainer" else ExecutorLostError
        async with self._heal_lock:
            if self.lost is not None:
                raise type(self.lost)(str(self.lost), self.role, restarted=False) from cause
            if self.incarnation != incarnation:  # another call lost with it already healed it
                raise error(f"{cause} (already replaced)", self.role, restarted=True) from cause
            if self._counted != incarnation:  # once per loss, even where a heal was cancelled
                self._counted = incarnation
                self.stats.failures[self.role] += 1
                self.stats.hung_kills += int(hung)
            self.stats.last_error = str(cause)
            if hung or not self.restartable:
                await asyncio.to_thread(_kill_quietly, handle)
            if not self.restartable:
                logger.error("%s", cause)
                self.lost = error(str(cause), self.role, restarted=False)
                raise self.lost from cause
            if self.stats.total_restarts >= self.stats.max_executor_restarts:
                self.lost = error(str(cause), self.role, restarted=False)
                raise RestartLimitError(
                    f"{cause}; {self.stats.total_restarts} executor restarts already "
                    f"(faults.max_executor_restarts={self.stats.max_executor_restarts}): the job stops"
                ) from cause
            logger.warning("%s; restarting it", cause)
            self._serving.clear()
            try:
                await self._replace(handle)
            except Exception as err:  # the fresh one did not come up: the job cannot heal here
                logger.error("executor %r could not be restarted: %s", handle.name, err)
                self.lost = error(f"{cause}; its restart failed: {err}", self.role, restarted=False)
                raise self.lost from err
            finally:
                self._serving.set()
        raise error(str(cause), self.role, restarted=True) from cause

    async def _replace(self, handle: ExecutorHandle) -> None:
        """Build the fresh executor, wait until it is ready and brought up to date, and
        only then route calls to it."""
        t0 = time.monotonic()
        self._busy_before += handle.busy_s
        fresh = await asyncio.to_thread(self.runtime.restart, handle)
        await fresh.ready()  # the model loads before any call's deadline starts
        if self.on_restart is not None:
            await self.on_restart(self)
        self.handle, self._queue = fresh, deque()
        self.incarnation += 1
        self.stats.restarts[self.role] += 1
        logger.warning(
            "executor %r restarted (%s) in %.1f s; its lost work is handed out again",
            self.name,
            self.where,
            time.monotonic() - t0,
        )


class _Queued:
    """One call in an executor's queue: its deadline key and limit, when it started running,
    and the future its caller waits on."""

    __slots__ = ("key", "limit", "started", "ran_s", "woken")

    def __init__(self, key: tuple[str, int], limit: float | None, woken: asyncio.Future) -> None:
        self.key, self.limit = key, limit
        self.woken = woken  # resolved with None when the call ends, with the hung call when one is
        self.started: float | None = None
        self.ran_s = 0.0


def call_key(method: str, args: tuple) -> tuple[str, int]:
    """Deadlines are kept per method and batch size (to the power of two): an eval
    ``generate`` of 200 prompts is not held to what 8-prompt training calls take."""
    batch = args[0] if args and isinstance(args[0], (list, tuple)) else ()
    return method, len(batch).bit_length()


def _kill_quietly(handle: ExecutorHandle) -> None:
    try:
        handle.kill()
    except NotImplementedError:
        logger.warning(
            "executor %r (%s) cannot be killed on this runtime; it is abandoned",
            handle.name,
            handle.where,
        )
    except Exception as err:  # noqa: BLE001 - it is being replaced either way
        logger.warning("killing executor %r failed: %s", handle.name, err)


def _take_outcome(future: asyncio.Future) -> None:
    """Mark a finished future's exception as retrieved (a call whose caller left)."""
    if not future.cancelled():
        future.exception()
