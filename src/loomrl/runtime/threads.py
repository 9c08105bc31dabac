"""The thread machinery under the runtimes: an executor's threads and their calls.

``WorkerThreads`` runs an executor's calls (its own thread, or the pool of its concurrent
endpoints); ``on_thread`` hands one call to them as a future of the controller's loop;
``CallTracker`` and ``BusyClock`` record what runs there and for how long; ``release_later``
frees what the loop is done with off the loop. The contract callers see (``Runtime``,
``ExecutorHandle``) is in ``loomrl.runtime.base``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from loomrl.telemetry import trace


class CallTracker:
    """Calls that started and have not returned, each a span on the executor's trace lane."""

    def __init__(self, name: str = "") -> None:
        self.name = name or None
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
            with trace.span(method, "call", self.name):
                yield
        finally:
            with self._lock:
                del self._running[call_id]

    def running(self) -> list[tuple[int, str, float]]:
        """``(call id, method, seconds running)`` of every unfinished call."""
        now = time.monotonic()
        with self._lock:
            return [(i, m, now - t0) for i, (m, t0) in self._running.items()]


class WorkerThreads:
    """Threads that run what they are given: an executor's own thread (``max_workers=1``:
    one call at a time, in order) or the pool of its concurrent endpoints. ``submit`` and
    ``shutdown`` as ``ThreadPoolExecutor``'s, and ``post``, for ``on_thread``: a call with
    no ``concurrent.futures.Future`` (nor its condition and locks, its done callback), so
    handing a call over is one queue put. Threads start when a call finds none idle, up to
    ``max_workers``. They are daemons: a call still running at exit does not hold the
    interpreter."""

    def __init__(self, name: str, max_workers: int = 1) -> None:
        self.name, self.max_workers = name, max_workers
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # posts, thread starts and a shutdown do not interleave
        self._shut = False
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a call and not yet promised one
        if max_workers == 1:  # an executor's thread: there from the start
            self._start_thread()
            self._idle = 1

    def _start_thread(self) -> None:
        name = self.name if self.max_workers == 1 else f"{self.name}_{len(self._threads)}"
        thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def post(self, run: Callable[[], None], on_cancel: Callable[[], None]) -> None:
        """Run ``run()`` on a thread after what is queued; ``on_cancel()`` instead (on
        the caller's thread) if a ``shutdown(cancel_futures=True)`` drops it unrun."""
        with self._lock:
            if self._shut:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < self.max_workers:
                self._start_thread()
            self._queue.put((run, on_cancel))

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as err:  # noqa: BLE001 - delivered to the caller
                    future.set_exception(err)

        self.post(run, future.cancel)
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            item[0]()
            del item  # (its arguments are not kept alive until the next call)
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """No more calls; with ``cancel_futures`` the queued ones are cancelled; with
        ``wait`` it returns once the threads ended (after the calls they run, if any)."""
        with self._lock:
            if not self._shut:
                self._shut = True
                dropped = []
                if cancel_futures:
                    try:
                        while True:
                            dropped.append(self._queue.get_nowait())
                    except queue.Empty:
                        pass
                for _ in self._threads:
                    self._queue.put(None)
                for item in dropped:
                    if item is not None:
                        item[1]()
        if wait:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()


class _Releaser:
    """Drops what the controller's loop is done with on a thread of its own, a few times a
    second: a trained batch (its groups' id, log-prob and text lists, a thousand objects a
    step, made on other threads) is not freed on the loop. ``release`` is one queue put that wakes nobody (the thread sleeps between drains)."""

    every_s = 0.2

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def release(self, obj: Any) -> None:
        """Let the releaser's thread hold (and so free) ``obj`` once its caller dropped it."""
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._drain, name="loomrl-release", daemon=True
                    )
                    self._thread.start()
        self._queue.put(obj)

    def _drain(self) -> None:
        while True:
            time.sleep(self.every_s)
            try:
                while True:
                    self._queue.get_nowait()  # (dropped here: the last reference, once its caller is done)
            except queue.Empty:
                pass


_RELEASER = _Releaser()


def release_later(obj: Any) -> None:
    """Free ``obj`` off the caller's thread (the controller's loop), within ~0.2 s; the
    caller must drop its own references soon (the last one is then the releaser's)."""
    _RELEASER.release(obj)


def on_thread(
    loop: asyncio.AbstractEventLoop,
    pool: WorkerThreads,
    on_done: Callable[[], None] | None,
    fn: Callable[..., Any],
    *args: Any,
    skip_cancelled: bool = False,
    post: Callable[[Any], Any] | None = None,
) -> asyncio.Future:
    """``fn(*args)`` on ``pool``'s thread, as a future of ``loop`` that the thread resolves
    with one ``call_soon_threadsafe``, in which ``on_done()`` runs too (a done callback
    would take a turn of the loop of its own). (``run_in_executor`` chains a concurrent
    future to an asyncio one: two futures, their callbacks and a state copy on the loop,
    every call.) ``skip_cancelled``: a call whose caller cancelled it before it started does
    not run (as with ``run_in_executor``). ``post``: the future resolves with
    ``post(fn(*args))``, run on that thread too (an exception from either is the future's).
    An item the pool drops unrun (a shutdown with ``cancel_futures``) cancels the future."""
    future = loop.create_future()

    def run() -> None:
        if skip_cancelled and future.cancelled():
            ok, value = False, asyncio.CancelledError()
        else:
            try:
                ok, value = True, fn(*args)
                if post is not None:
                    value = post(value)
            except BaseException as err:  # noqa: BLE001 - delivered to the caller, as run_in_executor does
                ok, value = False, err
        _threadsafe(loop, _deliver, future, ok, value, on_done)

    pool.post(run, lambda: _threadsafe(loop, future.cancel))
    return future


def _threadsafe(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the loop closed meanwhile: nobody waits for it
        pass


def _deliver(
    future: asyncio.Future, ok: bool, value: Any, on_done: Callable[[], None] | None
) -> None:
    """On the loop: resolve ``future`` with the call's result (``ok``) or exception, then ``on_done()``."""
    if not future.done():  # (a caller may have cancelled it)
        future.set_result(value) if ok else future.set_exception(value)
    if on_done is not None:
        on_done()


class BusyClock:
    """Seconds an executor spent in calls, added from whichever thread saw a call end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = 0.0

    def add(self, seconds: float) -> None:
        with self._lock:
            self._seconds += seconds

    @property
    def seconds(self) -> float:
        with self._lock:
            return self._seconds
