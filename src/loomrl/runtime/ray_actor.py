"""One executor as a Ray actor: the actor it lives in and the controller's handle to it.

The actor builds the executor object in its constructor and answers each call with a reply
``(status, value, traceback, busy_s)``; the handle sends calls in order (the actor runs one
at a time), unpacks the replies (an executor's exception re-raised as itself, with its
remote traceback as a note) and turns Ray's notice of a dead actor into
``ExecutorDiedError``. ``loomrl.runtime.ray`` places these actors on the cluster.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import ray
import ray.exceptions

from loomrl.runtime.base import ExecutorDiedError, ExecutorHandle, RemoteError
from loomrl.runtime.endpoints import check_implements
from loomrl.runtime.netif import bind_groups_to_node_address
from loomrl.runtime.threads import BusyClock, CallTracker
from loomrl.safe_text import SafeFormatter
from loomrl.telemetry import trace

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # building an executor loads a model; waiting for resources counts too
CLOSE_TIMEOUT_S = 30.0
# Ray errors that mean the actor is gone (or unreachable, which with no restarts is the same)
_DIED = tuple(
    getattr(ray.exceptions, name)
    for name in (
        "RayActorError",
        "ActorUnavailableError",
        "NodeDiedError",
        "WorkerCrashedError",
        "OwnerDiedError",
        "ObjectLostError",
        "LocalRayletDiedError",
    )
    if hasattr(ray.exceptions, name)
)


def _error_reply(err: BaseException, busy_s: float) -> tuple:
    tb = "".join(traceback.format_exception(err))
    try:  # an exception that does not pickle still arrives, as its text
        ray.cloudpickle.dumps(err)
    except Exception:  # noqa: BLE001
        err = RemoteError(f"{type(err).__name__}: {err}")
    return ("error", err, tb, busy_s)


class _ExecutorActor:
    """The actor every executor lives in: builds the object with ``factory`` in its
    constructor and answers ``call(method, args, kwargs)`` with ``(status, value, tb, busy_s)``.
    A factory that raises is remembered and reported by ``ready()`` (as itself), so that the
    controller sees the original error, not Ray's ``ActorDiedError``."""

    def __init__(
        self,
        name: str,
        factory: Callable[[], Any],
        interface: type | None,
        torch_threads: int,
        log_level: int,
    ) -> None:
        root = logging.getLogger()
        handler = logging.StreamHandler()  # Ray forwards the actor's stderr to the driver
        handler.setFormatter(SafeFormatter(f"%(levelname)s [{name}] %(name)s: %(message)s"))
        root.handlers[:] = [handler]
        root.setLevel(log_level)
        trace.configure_from_env(name)
        # lazy: torch loads when this runs, not with the module
        import torch

        torch.set_num_threads(torch_threads)
        self.obj: Any = None
        self.failure: tuple | None = None
        self.concurrent: dict[str, bool] = {}
        try:  # building is not a call: it does not count as busy time
            # before any gloo or NCCL group forms (a trainer's ranks, the weight transport's group)
            bind_groups_to_node_address(ray.util.get_node_ip_address())
            self.obj = factory()
            if interface is not None:
                self.concurrent = check_implements(self.obj, interface)
        except BaseException as err:  # noqa: BLE001 - reported by ready()
            self.failure = _error_reply(err, 0.0)

    def ready(self) -> tuple:
        if self.failure is not None:
            return self.failure
        context = ray.get_runtime_context()
        where = {
            "pid": os.getpid(),
            "node_id": context.get_node_id(),
            "actor_id": context.get_actor_id(),
            "ip": ray.util.get_node_ip_address(),
        }
        return ("ok", (self.concurrent, where), None, 0.0)

    def call(self, method: str, args: tuple, kwargs: dict) -> tuple:
        if self.failure is not None:
            return self.failure
        t0 = time.perf_counter()
        try:
            with trace.span(method, "executor"):
                result = getattr(self.obj, method)(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - every failure goes back to the caller
            return _error_reply(err, time.perf_counter() - t0)
        return ("ok", result, None, time.perf_counter() - t0)

    def close(self) -> None:
        closer = getattr(self.obj, "close", None)
        if callable(closer):
            closer()


_REMOTE_ACTOR = ray.remote(max_restarts=0, max_task_retries=0)(_ExecutorActor)


def how_it_died(err: BaseException) -> str:
    """Ray's long death notice cut to the sentence that says how the actor died."""
    text = " ".join(str(err).split())
    found = re.search(r"The actor is dead because (.*?)(?: Some common causes|$)", text)
    how = found.group(1) if found else text
    return how if len(how) <= 400 else how[:400] + "..."


class RayHandle(ExecutorHandle):
    def __init__(
        self,
        name: str,
        factory: Callable[[], Any],
        actor_name: str,
        options: dict[str, Any],
        torch_threads: int,
        interface: type | None = None,
    ) -> None:
        self.name, self.factory, self.actor_name = name, factory, actor_name
        self._bind_interface(interface)
        self.calls = CallTracker(self.name)
        self._busy = BusyClock()
        self._dead: ExecutorDiedError | None = None
        self._info: dict[str, Any] = {}
        self.concurrent: dict[str, bool] = {}
        self._driver_node = ray.get_runtime_context().get_node_id()
        self.actor = _REMOTE_ACTOR.options(name=actor_name, max_concurrency=1, **options).remote(
            name, factory, interface, torch_threads, logging.getLogger().getEffectiveLevel()
        )
        # Building the object (loading a model) runs in the background; calls queue behind
        # it, so executors that must meet (a torch_dist group) start together.
        self._ready: Future = Future()
        self.actor.ready.remote().future().add_done_callback(self._on_ready)

    def _on_ready(self, done: Future) -> None:
        """Runs on a Ray thread, which must not call back into Ray (it would deadlock)."""
        try:
            concurrent, info = self._unpack(done)
        except BaseException as err:  # noqa: BLE001 - the start's failure, for wait_ready and calls
            self._ready.set_exception(err)
            return
        self._info, self.concurrent = info, concurrent
        self._ready.set_result(concurrent)

    def _died(self, err: BaseException) -> ExecutorDiedError:
        if self._dead is None:
            self._dead = ExecutorDiedError(
                f"executor {self.name!r} ({self.where}) died: {how_it_died(err)}; its call was lost"
            )
        return self._dead

    def _unpack(self, done: Future) -> Any:
        """A reply, as its value or its raised error."""
        try:
            status, value, tb, busy_s = done.result()
        except (
            ray.exceptions.RayTaskError
        ) as err:  # the reply itself failed (a result that does not pickle)
            raise err.as_instanceof_cause() from None
        except _DIED as err:
            raise self._died(err) from err
        self._busy.add(busy_s)
        if status == "error":
            value.add_note(f"raised in executor {self.name!r} ({self.where}):\n{tb}")
            raise value
        return value

    async def wait_started(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, bool]:
        """The executor's ``{endpoint: concurrent}`` once it is built; its build error else."""
        try:
            return await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(self._ready)), timeout_s
            )
        except TimeoutError:
            raise TimeoutError(
                f"executor {self.name!r} did not start within {timeout_s:.0f}s (still loading, or the "
                f"cluster lacks the resources it asks for; free now: {ray.available_resources()})"
            ) from None
        finally:
            if self._ready.done() and self._ready.exception() is not None and self._dead is None:
                self.close()  # a failed start: its actor's resources go back to the cluster

    async def ready(self) -> None:
        """Wait until the executor is built (its model loaded); raises if building failed."""
        await self.wait_started()

    async def _invoke(self, method: str, args: tuple, kwargs: dict) -> Any:
        if self._ready.done() and self._ready.exception() is not None:
            raise self._ready.exception()  # why it never started, not that it was ended since
        if self._dead is not None:
            raise self._dead
        with self.calls.track(method):
            reply = self.actor.call.remote(
                method, args, kwargs
            ).future()  # submitted now: order kept
            await self.wait_started()
            try:
                await asyncio.wrap_future(reply)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - unpacked below, as the executor's error
                pass
            return self._unpack(reply)

    @property
    def busy_s(self) -> float:
        return self._busy.seconds

    @property
    def where(self) -> str:
        if not self._info:
            return f"Ray actor {self.actor_name} (starting)"
        info = self._info
        return f"Ray actor {info['actor_id']} pid {info['pid']} on node {info['ip']}"

    @property
    def node_id(self) -> str | None:
        """The Ray node the actor runs on, once it started (else None)."""
        return self._info.get("node_id")

    @property
    def pid(self) -> int | None:
        """The actor's process id, where that process is on this host (else None)."""
        if not self._info or self._info["node_id"] != self._driver_node:
            return None
        return self._info["pid"]

    @property
    def alive(self) -> bool:
        return self._dead is None

    def kill(self) -> None:
        """``ray.kill`` the actor: its pending and later calls fail with ``ExecutorDiedError``."""
        ray.kill(self.actor, no_restart=True)
        if self._dead is None:
            self._dead = ExecutorDiedError(f"executor {self.name!r} ({self.where}) was killed")

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Let the executor release what it holds (its ``close()``), then end its actor."""
        started = self._ready.done() and self._ready.exception() is None
        if started and self._dead is None:
            try:
                ray.get(self.actor.close.remote(), timeout=timeout_s)
            except Exception as err:  # noqa: BLE001 - closing must go on; the cause is logged
                logger.warning("executor %r did not close cleanly: %s", self.name, err)
        ray.kill(self.actor, no_restart=True)
        if self._dead is None:
            self._dead = ExecutorDiedError(f"executor {self.name!r} ({self.where}) was closed")
