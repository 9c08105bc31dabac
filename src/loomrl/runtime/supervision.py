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
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from loomrl.runtime.base import ExecutorDiedError, ExecutorHandle, ExecutorHungError, Runtime

logger = logging.getLogger(__name__)


class ExecutorLostError(RuntimeError):
    """A call's executor died or hung: the call's work is lost (and the executor was
    replaced, if its role restarts). The caller re-queues the work."""

    def __init__(self, message: str, role: str, restarted: bool) -> None:
        super().__init__(message)
        self.role, self.restarted = role, restarted


class TrainerLostError(ExecutorLostError):
    """The trainer died or hung; the job restarts from its last checkpoint (or fails)."""


class RestartLimitError(RuntimeError):
    """More executors died than ``faults.max_executor_restarts`` allows in one run."""


def role_of(name: str) -> str:
    """``generator1`` -> ``generator``: executors of one role share deadlines and counts."""
    return re.sub(r"\d+$", "", name)


class Deadlines:
    """Per ``(role, method)`` deadlines from the durations of the calls seen so far."""

    def __init__(self, factor: float = 10.0, min_s: float = 60.0, first_s: float = 900.0, calls: int = 3) -> None:
        self.factor, self.min_s, self.first_s, self.calls = factor, min_s, first_s, calls
        self._longest: dict[tuple[str, str], float] = {}
        self._count: Counter[tuple[str, str]] = Counter()

    @classmethod
    def from_config(cls, faults) -> Deadlines:
        return cls(faults.deadline_factor, faults.min_deadline_s, faults.first_call_deadline_s, faults.deadline_calls)

    def limit(self, role: str, method: str) -> float:
        key = (role, method)
        if self._count[key] < self.calls:
            return max(self.first_s, self.min_s)
        return max(self.min_s, self.factor * self._longest[key])

    def observe(self, role: str, method: str, seconds: float) -> None:
        key = (role, method)
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
        self.rescored_rollouts = 0  # rollouts sent to a scorer again after their score call was lost
        self.lost_rollouts = 0  # rollouts whose second score call was lost too (counted as failed)
        self.trainer_restarts = 0  # job restarts from a checkpoint (set by the session)
        self.last_error: str | None = None

    @property
    def total_restarts(self) -> int:
        return sum(self.restarts.values())

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            "executor/restarts": self.total_restarts,
            "executor/hung_kills": self.hung_kills,
            "executor/requeued_prompts": self.requeued_prompts,
            "executor/rescored_rollouts": self.rescored_rollouts,
            "executor/lost_rollouts": self.lost_rollouts,
            "executor/trainer_restarts": self.trainer_restarts,
        }
        for role in ("generator", "scorer", "trainer", *self.failures):
            out[f"executor/{role}_failures"] = self.failures[role]
        for role in ("generator", "scorer", *self.restarts):
            out[f"executor/{role}_restarts"] = self.restarts[role]
        return out


class Supervised:
    """One executor as the controller sees it: ``await slot.generate(requests)`` calls the
    current handle under a deadline and heals the executor when the call is lost (module
    docstring). Everything else (``name``, ``calls``, ``where``, ``pid``) is the current
    handle's; ``busy_s`` adds up the executor's incarnations."""

    def __init__(
        self,
        runtime: Runtime | None,
        handle: ExecutorHandle,
        deadlines: Deadlines,
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
        self._busy_before = 0.0
        self._heal_lock = asyncio.Lock()
        self.in_flight = 0  # calls running now (the scorer pool balances on it)
        self.lost: ExecutorLostError | None = None  # a role that does not restart: what lost it

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

    def __getattr__(self, method: str) -> Callable[..., Awaitable[Any]]:
        if method.startswith("_"):
            raise AttributeError(method)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self.call(method, *args, **kwargs)

        call.__name__ = method
        return call

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.lost is not None:  # counted once, when it was lost
            raise type(self.lost)(str(self.lost), self.role, restarted=False)
        handle, incarnation = self.handle, self.incarnation
        deadline = self.deadlines.limit(self.role, method)
        t0 = time.monotonic()
        self.in_flight += 1
        try:
            result = await asyncio.wait_for(handle.call(method, *args, **kwargs), deadline)
        except TimeoutError:
            cause: BaseException = ExecutorHungError(
                f"executor {handle.name!r} ({handle.where}): {method!r} ran past its deadline of {deadline:.1f} s "
                f"(faults.deadline_factor x the longest {self.role}.{method} call so far); killed"
            )
            await self._heal(handle, incarnation, cause, hung=True)
        except ExecutorDiedError as err:
            await self._heal(handle, incarnation, err, hung=False)
        finally:
            self.in_flight -= 1
        self.deadlines.observe(self.role, method, time.monotonic() - t0)
        return result

    async def _heal(self, handle: ExecutorHandle, incarnation: int, cause: BaseException, hung: bool) -> None:
        """Count the loss, replace the executor (once for all the calls lost with it) and
        raise ``ExecutorLostError`` (``TrainerLostError`` for the trainer)."""
        error = TrainerLostError if self.role == "trainer" else ExecutorLostError
        async with self._heal_lock:
            if self.incarnation != incarnation:  # another call lost with it already healed it
                raise error(f"{cause} (already replaced)", self.role, restarted=True) from cause
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
                raise RestartLimitError(
                    f"{cause}; {self.stats.total_restarts} executor restarts already "
                    f"(faults.max_executor_restarts={self.stats.max_executor_restarts}): the job stops"
                ) from cause
            logger.warning("%s; restarting it", cause)
            t0 = time.monotonic()
            self._busy_before += handle.busy_s
            self.handle = await asyncio.to_thread(self.runtime.restart, handle)
            self.incarnation += 1
            await self.handle.ready()  # the model loads before the first call's deadline starts
            self.stats.restarts[self.role] += 1
            if self.on_restart is not None:
                await self.on_restart(self)
            logger.warning("executor %r restarted (%s) in %.1f s; its lost work is handed out again",
                           self.name, self.where, time.monotonic() - t0)  # fmt: skip
        raise error(str(cause), self.role, restarted=True) from cause


def _kill_quietly(handle: ExecutorHandle) -> None:
    try:
        handle.kill()
    except NotImplementedError:
        logger.warning("executor %r (%s) cannot be killed on this runtime; it is abandoned", handle.name, handle.where)
    except Exception as err:  # noqa: BLE001 - it is being replaced either way
        logger.warning("killing executor %r failed: %s", handle.name, err)
