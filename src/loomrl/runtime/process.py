"""The ``process`` runtime: every executor lives in its own (spawned) process on this host.

Same contract as ``local``: calls to one executor run one at a time, in order; different
executors run in parallel. (Endpoints declared ``concurrent`` still run one at a time here:
one pipe carries one call at a time. The executor reports the flags at start-up, in
``ProcessHandle.concurrent``, for a runtime that multiplexes calls.) Each executor has its own interpreter, so a generator and a
trainer no longer take turns on one GIL (the ``local`` runtime's limit for small models,
where per-op Python overhead dominates; see ``bench/async_vs_sync.py``).

Calls and results travel pickled over a pipe (the executor protocol carries plain data:
requests, rollouts, metrics, state dicts); weights travel through the job's transport
(``shm``, ``files`` or ``torch_dist``), never through the pipe. An exception raised by a
method is re-raised in the controller with its remote traceback attached. An executor
that dies (killed, out of memory, segfault) fails its pending and later calls with
``ExecutorDiedError``, naming the exit code or signal. An executor whose controller dies
sees its pipe close and exits.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import select
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from loomrl.runtime.base import (
    ExecutorDiedError,
    ExecutorHandle,
    RemoteError,
    Runtime,
    then,
)
from loomrl.runtime.endpoints import check_implements
from loomrl.runtime.threads import BusyClock, CallTracker, WorkerThreads, on_thread
from loomrl.telemetry import trace

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # building an executor loads a model: generous, but not forever
LIVENESS_CHECK_S = 0.25  # how often a wait on an executor's pipe checks that its process lives
_CTX = multiprocessing.get_context("spawn")  # never fork a controller that runs threads


def _dumps(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _error_reply(err: BaseException, busy_s: float) -> bytes:
    tb = "".join(traceback.format_exception(err))
    try:
        return _dumps(("error", err, tb, busy_s))
    except Exception:  # noqa: BLE001 - an exception that does not pickle still arrives, as its text
        return _dumps(("error", RemoteError(f"{type(err).__name__}: {err}"), tb, busy_s))


class _PipeLogHandler(logging.Handler):
    """Executor side: send each log record, formatted and tagged with the executor's name,
    to the controller over this executor's own log pipe. (Not a multiprocessing.Queue: its
    write lock is shared by every process, and an executor killed while holding it would
    hang every other writer, the controller included.)"""

    def __init__(self, conn: Connection, name: str) -> None:
        super().__init__()
        self.conn, self.executor = conn, name

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.msg, record.args = f"[{self.executor}] {record.getMessage()}", None
            if record.exc_info:
                record.msg += "\n" + self.formatException(record.exc_info)
                record.exc_info = record.exc_text = None
            self.conn.send(record)
        except Exception:  # noqa: BLE001 - the controller is gone, or the record won't pickle
            pass


def _forward_logs(conn: Connection, process: multiprocessing.process.BaseProcess) -> None:
    """Controller side: hand an executor's records to the controller's own loggers, so they
    show up where the controller's logs do (the CLI's rich console, a log file ...). Ends
    when the executor's process does, though a child of it may hold the pipe open."""
    while True:
        try:
            if not conn.poll(LIVENESS_CHECK_S):
                if process.is_alive():
                    continue
                if not conn.poll(0):  # gone, and everything it sent was read
                    conn.close()
                    return
            record = conn.recv()
        except (EOFError, OSError):  # the executor is gone
            conn.close()
            return
        target = logging.getLogger(record.name)
        if target.isEnabledFor(record.levelno):
            target.handle(record)


def _serve(
    conn: Connection,
    name: str,
    factory: Callable[[], Any],
    interface: type | None,
    torch_threads: int,
    log_conn: Connection,
    log_level: int,
) -> None:
    """The executor process: build the object, then answer calls until told to stop."""
    root = logging.getLogger()
    root.handlers[:] = [_PipeLogHandler(log_conn, name)]
    root.setLevel(log_level)
    trace.configure_from_env(name)
    # the controller's to handle, also when sent to the process group: it checkpoints,
    # then stops us
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    # lazy: torch loads in the executor's process once its signals are set, not with the runtime
    import torch

    torch.set_num_threads(torch_threads)
    try:  # building is not a call: it does not count as busy time (as in ``local``)
        obj = factory()
        concurrent = check_implements(obj, interface) if interface is not None else {}
    except BaseException as err:  # noqa: BLE001 - reported to the controller, then exit
        conn.send_bytes(_error_reply(err, 0.0))
        return
    conn.send_bytes(_dumps(("ok", concurrent, None, 0.0)))
    try:
        _answer_calls(conn, obj)
    finally:  # asked to stop, or the controller is gone: release what the object holds
        closer = getattr(obj, "close", None)
        if callable(closer):
            closer()
    try:
        conn.send_bytes(_dumps(("ok", None, None, 0.0)))  # closed
    except OSError:
        pass


def _answer_calls(conn: Connection, obj: Any) -> None:
    """Run calls until a shutdown request (method None) or until the controller is gone."""
    while True:
        try:
            method, args, kwargs = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the controller is gone
            return
        if method is None:
            return
        t0 = time.perf_counter()
        try:
            with trace.span(method, "executor"):
                result = getattr(obj, method)(*args, **kwargs)
            reply = _dumps(("ok", result, None, time.perf_counter() - t0))
        except BaseException as err:  # noqa: BLE001 - every failure goes back to the caller
            reply = _error_reply(err, time.perf_counter() - t0)
        try:
            conn.send_bytes(reply)
        except OSError:  # the controller died while this call ran
            return


class ProcessHandle(ExecutorHandle):
    def __init__(
        self,
        name: str,
        factory: Callable[[], Any],
        torch_threads: int,
        interface: type | None = None,
    ) -> None:
        self.name, self.factory = name, factory
        self._bind_interface(interface)
        self._conn, child = _CTX.Pipe()
        self._readable = select.poll()  # the reply pipe has data, or its other end closed
        self._readable.register(self._conn.fileno(), select.POLLIN)
        log_reader, log_writer = _CTX.Pipe(duplex=False)
        self.process = _CTX.Process(
            target=_serve,
            name=f"loomrl-{name}",
            daemon=True,
            args=(
                child,
                name,
                factory,
                interface,
                torch_threads,
                log_writer,
                logging.getLogger().getEffectiveLevel(),
            ),
        )
        self.process.start()
        child.close()
        log_writer.close()  # the executor holds the only writer: its exit ends the forwarder
        self._log_forwarder = threading.Thread(
            target=_forward_logs,
            args=(log_reader, self.process),
            name=f"loomrl-{name}-logs",
            daemon=True,
        )
        self._log_forwarder.start()
        self._busy = BusyClock()
        self.calls = CallTracker(self.name)
        self._dead: ExecutorDiedError | None = None
        # One thread talks to the process, so calls are serialized in submission order.
        self._pool = WorkerThreads(f"loomrl-{name}")
        # Building the object (loading a model) runs in the background; the first call
        # waits for it, so executors that must meet (a torch_dist group) start together.
        self._ready = self._pool.submit(self._reply, START_TIMEOUT_S)
        self._started = False  # _ready is done and succeeded (set by _check_started)

    def _join(self, timeout_s: float) -> None:
        """``process.join(timeout_s)`` by its pid: ``join`` waits on the process sentinel,
        which a child the executor forked keeps open after the executor is gone."""
        deadline = time.monotonic() + timeout_s
        while self.process.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    def _died(self) -> ExecutorDiedError:
        if self._dead is None:
            self._join(5)
            code = self.process.exitcode
            how = (
                f"killed by {signal.Signals(-code).name}"
                if code is not None and code < 0
                else f"exited with code {code}"
            )
            self._dead = ExecutorDiedError(
                f"executor {self.name!r} (pid {self.process.pid}) {how}; its call was lost"
            )
        return self._dead

    def _wait_readable(self, timeout_s: float | None) -> None:
        """Until the reply pipe has data; raises ``_died()`` once the process is gone with
        nothing left to read. The process is watched by its pid, not by its pipes: a child
        the executor forked (a reward's helper) holds the reply pipe and the process
        sentinel open for as long as it lives, so neither closes when the executor dies."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = (
                LIVENESS_CHECK_S
                if deadline is None
                else min(deadline - time.monotonic(), LIVENESS_CHECK_S)
            )
            # a kept poll object, not Connection.poll, which builds a selector each time
            if self._readable.poll(max(remaining, 0.0) * 1000):
                return
            if not self.process.is_alive():  # (waitpid): a reply sent before is in the pipe
                if self._conn.poll(0):
                    return
                raise self._died()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"executor {self.name!r} did not start within {timeout_s:.0f}s")

    def _reply(self, timeout_s: float | None = None) -> Any:
        try:
            self._wait_readable(timeout_s)
            status, value, tb, busy_s = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError, ConnectionError) as err:
            raise self._died() from err
        self._busy.add(busy_s)
        if status == "error":
            value.add_note(f"raised in executor {self.name!r} (pid {self.process.pid}):\n{tb}")
            raise value
        return value

    def _call(self, method: str | None, args: tuple, kwargs: dict) -> Any:
        if self._dead is not None:
            raise self._dead
        payload = _dumps((method, args, kwargs))
        with self.calls.track(method or "close"):
            try:
                self._conn.send_bytes(payload)
            except (BrokenPipeError, ConnectionError, OSError) as err:
                raise self._died() from err
            return self._reply()

    def _check_started(self) -> bool:
        """Whether the executor was built (checked on the future until it was: each look
        takes its lock; from then on a flag)."""
        self._started = self._ready.done() and self._ready.exception() is None
        return self._started

    @property
    def concurrent(self) -> dict[str, bool]:
        """``{endpoint: concurrent}`` as the executor declared it (after it started)."""
        return (
            self._ready.result() if self._ready.done() and self._ready.exception() is None else {}
        )

    async def ready(self) -> None:
        await asyncio.wrap_future(self._ready)

    async def _invoke(self, method: str, args: tuple, kwargs: dict) -> Any:
        if self._ready.done():  # (wrapping a done future still costs a wake-up of the loop)
            self._ready.result()  # a start that failed raises here
        else:
            await asyncio.wrap_future(self._ready)
        return await self._submit(method, args, kwargs)

    def _submit(
        self,
        method: str,
        args: tuple,
        kwargs: dict,
        on_done: Callable[[], None] | None = None,
        post: Callable[[Any], Any] | None = None,
    ) -> asyncio.Future:
        if not self._started and not self._check_started():  # waits, or raises the start's error
            return super()._submit(method, args, kwargs, on_done, post)
        loop = asyncio.get_running_loop()
        try:  # (``post`` runs on the transport thread, once the result is unpickled)
            return on_thread(loop, self._pool, on_done, self._call, method, args, kwargs, post=post)
        except RuntimeError as err:  # the pool was shut down: the handle was closed (replaced)
            if "after shutdown" not in str(err):
                raise
            closed = self._dead or ExecutorDiedError(
                f"executor {self.name!r} (pid {self.process.pid}) was closed"
            )
            failed = loop.create_future()
            failed.set_exception(closed)
            return then(failed, on_done)

    @property
    def busy_s(self) -> float:
        return self._busy.seconds

    @property
    def where(self) -> str:
        return f"pid {self.process.pid}"

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self._dead is None and self.process.is_alive()

    def kill(self) -> None:
        """SIGKILL the executor's process: its pending call fails with ``ExecutorDiedError``."""
        if self.process.is_alive():
            try:
                os.kill(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._join(5)

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the executor to close and exit; kill it if it does not within ``timeout_s``."""
        try:
            started = self._ready.exception(timeout=timeout_s) is None  # else: already reported
            if started and self.process.is_alive():
                self._pool.submit(self._call, None, (), {}).result(timeout=timeout_s)
        except Exception as err:  # noqa: BLE001 - closing must go on; the cause is logged
            logger.warning("executor %r did not close cleanly: %s", self.name, err)
        self._join(timeout_s)
        if self.process.is_alive():
            logger.warning("killing executor %r (pid %d)", self.name, self.process.pid)
            os.kill(self.process.pid, signal.SIGKILL)
            self._join(30)
        if self._dead is None:
            self._dead = ExecutorDiedError(
                f"executor {self.name!r} (pid {self.process.pid}) was closed"
            )
        self._pool.shutdown(wait=False)  # calls still queued run and fail at once with _dead
        self._conn.close()
        self._log_forwarder.join(timeout=5)  # the executor's last records are shown


class ProcessRuntime(Runtime):
    """``factory`` must pickle (a module-level function or a ``functools.partial`` of one):
    it runs in the new process. Scripts that start a job need the usual
    ``if __name__ == "__main__":`` guard, as with any spawned process."""

    in_process = False

    def __init__(self, torch_threads: int = 1) -> None:
        # lazy: torch loads in the executor's process once its signals are set, not with the runtime
        import torch

        torch.set_num_threads(torch_threads)
        self.torch_threads = torch_threads
        self.handles: list[ProcessHandle] = []

    def start(
        self, name: str, factory: Callable[[], Any], interface: type | None = None
    ) -> ProcessHandle:
        try:
            pickle.dumps(factory)
        except Exception as err:
            raise TypeError(
                f"the factory of executor {name!r} must pickle to reach its process (a "
                f"module-level function or a functools.partial of one): {err}"
            ) from err
        handle = ProcessHandle(name, factory, self.torch_threads, interface)
        self.handles.append(handle)
        return handle

    async def wait_ready(self) -> None:
        await asyncio.gather(*(asyncio.wrap_future(h._ready) for h in self.handles))

    def shutdown(self) -> None:
        for handle in self.handles:
            handle.close()
        self.handles.clear()
