"""Loading user code by import path, and scoring with a timeout.

A reward function is ``fn(prompt, completion, **row) -> float``, sync or async. A call that
raises, returns something that is not a finite number (or one past what float32 holds, which
training could not use), or runs past its timeout marks the rollout failed (counted, never trained on). A sync function that hangs cannot be stopped
from Python: it is left running in a daemon thread and counted under ``timeout``; code
that must be stopped belongs in a sandbox (``loomrl.sandbox``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from operator import itemgetter
from pathlib import Path
from typing import Any

from loomrl.types import PartedReward

logger = logging.getLogger(__name__)


class UserCodeError(ValueError):
    """An import path that names nothing callable."""


# a function object given to Job(reward=...), found in this process only
REGISTERED_PREFIX = "loomrl.registered:"
_registered: dict[str, Any] = {}


def callable_path(fn: Callable[..., Any]) -> str:
    """An import path for ``fn``: ``module:qualname`` when importing that gives ``fn`` back
    (a top-level function of an importable module), else a name registered in this process
    (``loomrl.registered:<name>-<n>``), which only this process can load."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module and module != "__main__" and name.isidentifier():
        try:
            if getattr(importlib.import_module(module), name, None) is fn:
                return f"{module}:{name}"
        except Exception:  # noqa: BLE001 - not importable: registered instead
            pass
    key = f"{REGISTERED_PREFIX}{getattr(fn, '__name__', 'reward')}-{len(_registered)}".replace(
        "<", ""
    ).replace(">", "")
    _registered[key] = fn
    return key


def is_registered(path: str) -> bool:
    return path.startswith(REGISTERED_PREFIX)


def load_object(path: str) -> Any:
    """``'package.module:name'`` -> the object. The working directory is importable."""
    if is_registered(path):
        if path not in _registered:
            raise UserCodeError(
                f"{path!r} names a function registered in another process (Job(reward=fn)); pass "
                "an importable 'module:function' to run the reward in other processes"
            )
        return _registered[path]
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise UserCodeError(f"{path!r} is not an import path of the form 'module:name'")
    cwd = str(Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserCodeError(f"cannot import module {module_name!r} for {path!r}: {err}") from None
    except Exception as err:  # noqa: BLE001 - user code: its module raised while importing
        raise UserCodeError(
            f"cannot import module {module_name!r} for {path!r}: importing it raised {type(err).__name__}: {err}"
        ) from err
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UserCodeError(f"module {module_name!r} has no attribute {attr!r}") from None


class RewardFailure(Exception):
    """A reward call that cannot score the rollout; ``reason`` is one of raised/invalid/timeout."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


FP32_MAX = 3.4028234663852886e38  # the largest float32: a reward past it is inf in training


def _describe_number(value: int | float) -> str:
    """A number for a message: a float as is, a huge int by its size (its digits would
    run to hundreds of characters, and past 4300 repr itself raises)."""
    if isinstance(value, int) and abs(value) > 10**20:
        return f"a {value.bit_length()}-bit int ({'-' if value < 0 else ''}~2**{value.bit_length() - 1})"
    return repr(value)


def _safe_repr(value: Any) -> str:
    """At most 200 characters of ``repr(value)``, whatever the value's repr does."""
    try:
        text = repr(value)
    except Exception as err:  # noqa: BLE001 - user objects: a list of huge ints, a raising __repr__
        return f"<a {type(value).__name__} whose repr raised {type(err).__name__}>"
    return text if len(text) <= 200 else text[:200] + "..."


def check_value(value: Any) -> float:
    """The reward as a float the trainer can hold (in float32), or ``RewardFailure``:
    ``invalid`` for what is not a number (or nan/inf), ``out_of_range`` for a number past
    float32 (an int too large for a float included). A bool is 1.0 or 0.0; a reward list's
    ``PartedReward`` is kept as it is. None is ``invalid`` here: a reward that returns None
    (not applicable) is read as such before (``loomrl.scoring.reward_list``)."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)):
        raise RewardFailure(
            "invalid", f"reward function returned {_safe_repr(value)}, expected a float"
        )
    try:
        number = float(value)
    except OverflowError:  # an int past float64
        number = math.inf
    if math.isnan(number) or (isinstance(value, float) and math.isinf(number)):
        raise RewardFailure("invalid", f"reward function returned non-finite {value}")
    if abs(number) > FP32_MAX:
        raise RewardFailure(
            "out_of_range",
            f"reward function returned {_describe_number(value)}, out of range "
            f"(a reward must be finite and within float32, |r| <= {FP32_MAX:.4g})",
        )
    # (a reward list's total keeps its parts, for samples.jsonl)
    return value if isinstance(value, PartedReward) else number


class DaemonThreads:
    """A pool of daemon worker threads for sync reward calls.

    Workers are reused (a thread per call costs more than most rewards), and are daemons,
    so a reward that hangs forever never blocks interpreter exit. Each timed-out call adds
    one worker in place of the one it may still be holding.
    """

    def __init__(self, size: int = 4) -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._size = size
        self._started = 0

    def _work(self) -> None:
        while True:
            task = self._tasks.get()
            try:
                task()
            except Exception:  # noqa: BLE001 - a task's bug must not cost the pool a worker
                logger.exception("a reward worker task failed; the worker goes on")

    def _spawn(self) -> None:
        threading.Thread(target=self._work, name="reward", daemon=True).start()
        self._started += 1

    def submit(self, task: Callable[[], None]) -> None:
        with self._lock:
            while self._started < self._size:
                self._spawn()
        self._tasks.put(task)

    @property
    def size(self) -> int:
        return self._size

    def replace_hung_worker(self) -> None:
        with self._lock:
            self._size += 1
            self._spawn()


_REWARD_THREADS = DaemonThreads()

# A batch expected to take less than this runs on one worker: waking each further worker
# (and the loop once per chunk) costs more than the split saves. Per reward function, the
# running mean of its item seconds; a function not seen yet is split across the workers.
PARALLEL_MIN_S = 0.002
_item_seconds: dict[Any, float] = {}


def _chunk_count(fn: Callable[..., Any], n: int) -> int:
    per_item = _item_seconds.get(fn)
    if per_item is not None and per_item * n < PARALLEL_MIN_S:
        return 1
    return min(n, _REWARD_THREADS.size)


def _observe_item_seconds(fn: Callable[..., Any], outcomes: dict[int, tuple[Any, float]]) -> None:
    if not outcomes:
        return
    mean = sum(map(itemgetter(1), outcomes.values())) / len(outcomes)
    old = _item_seconds.get(fn)
    _item_seconds[fn] = mean if old is None else 0.8 * old + 0.2 * mean


async def call_reward(
    fn: Callable[..., Any], prompt: str, completion: str, row: dict[str, Any], timeout_s: float
) -> float:
    """Score one completion; raises ``RewardFailure`` on any failure."""
    kwargs = {k: v for k, v in row.items() if k not in ("prompt", "completion")}
    if inspect.iscoroutinefunction(fn):
        status, value = await _call_async_reward(fn, prompt, completion, kwargs, timeout_s)
    else:
        status, value = await _call_sync_reward(fn, prompt, completion, kwargs, timeout_s)
    if status == "raised":
        raise RewardFailure("raised", f"reward function raised {_describe(value)}")
    if status == "failure":
        raise value
    return check_value(value)


async def _call_async_reward(
    fn: Callable[..., Any], prompt: str, completion: str, kwargs: dict[str, Any], timeout_s: float
) -> tuple[str, Any]:
    """``(status, value)`` of an async reward on the loop; ``timeout`` also when it blocked
    the loop past ``timeout_s`` (so that the timeout could not fire)."""
    started = time.monotonic()
    try:
        status, value = await asyncio.wait_for(
            _guarded(fn(prompt, completion, **kwargs)), timeout_s
        )
    except TimeoutError:
        raise RewardFailure("timeout", f"reward function took longer than {timeout_s}s") from None
    late_s = time.monotonic() - started
    if late_s > timeout_s:  # it blocked the loop, so the timeout could not fire in time
        raise RewardFailure(
            "timeout",
            f"reward function took {late_s:.2f}s, longer than {timeout_s}s (an async reward that "
            "blocked the event loop: its late value refused; await, or run blocking work in a thread)",
        )
    return status, value


async def _call_sync_reward(
    fn: Callable[..., Any], prompt: str, completion: str, kwargs: dict[str, Any], timeout_s: float
) -> tuple[str, Any]:
    """``(status, value)`` of a sync reward run on a reward worker thread; a worker hung
    past ``timeout_s`` is left to it and replaced."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def target() -> None:
        try:
            result: Any = ("ok", fn(prompt, completion, **kwargs))
        except (
            RewardFailure
        ) as failure:  # a reward list's part, or a TRL reward's reply, was refused
            result = ("failure", failure)
        except (Exception, SystemExit) as err:  # noqa: BLE001 - user code; sys.exit() must not kill the worker
            result = ("raised", err)
        try:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))
        except RuntimeError:  # the loop closed while a timed-out call was still running
            pass

    _REWARD_THREADS.submit(target)
    try:
        return await asyncio.wait_for(future, timeout_s)
    except TimeoutError:
        _REWARD_THREADS.replace_hung_worker()
        raise RewardFailure("timeout", f"reward function took longer than {timeout_s}s") from None


async def call_reward_batch(
    fn: Callable[..., Any], items: list[tuple[str, str, dict[str, Any]]], timeout_s: float
) -> list[tuple[float | RewardFailure, float]]:
    """Score ``(prompt, completion, row)`` items; for each, its reward or the
    ``RewardFailure``, and the seconds it took. Same rules as ``call_reward``, one item at a
    time, but a sync function runs the whole batch on one worker thread, so the event loop
    pays one wake-up per batch instead of one per item. Each item keeps its own timeout,
    counted from when it starts: one that runs past it fails with ``timeout``, its worker is
    left to it (and replaced), and the items after it go on on another worker."""
    if inspect.iscoroutinefunction(fn):
        return list(await asyncio.gather(*(_timed_call(fn, *item, timeout_s) for item in items)))
    # item -> (reward or RewardFailure, seconds), written by the workers: a worker also
    # filters each row and checks each value, so the loop does no Python per item.
    outcomes: dict[int, tuple[float | RewardFailure, float]] = {}
    # Contiguous chunks, one per worker: rewards that release the GIL (I/O, subprocesses,
    # numpy) still run side by side, and the loop wakes once per chunk, not per item. A
    # function whose batches take microseconds runs a batch on one worker.
    chunks = _chunk_count(fn, len(items))
    bounds = [(len(items) * k // chunks, len(items) * (k + 1) // chunks) for k in range(chunks)]
    await asyncio.gather(*(_run_chunk(fn, items, lo, hi, outcomes, timeout_s) for lo, hi in bounds))
    _observe_item_seconds(fn, outcomes)
    return list(map(outcomes.__getitem__, range(len(items))))


async def _run_chunk(fn, calls: list, lo: int, hi: int, outcomes: dict, timeout_s: float) -> None:
    """Items ``lo..hi-1`` in order on a worker; a hung one times out alone and the rest go
    on on another worker."""
    start = lo
    while start < hi:
        run = _BatchRun(fn, calls[:hi], start, outcomes, asyncio.get_running_loop())
        _REWARD_THREADS.submit(run)
        try:
            hung = await run.wait(timeout_s)
        except asyncio.CancelledError:  # the job is stopping: leave the worker to its item
            if run.abandon():
                _REWARD_THREADS.replace_hung_worker()
            raise
        if hung is None:
            return
        outcomes[hung] = (
            RewardFailure("timeout", f"reward function took longer than {timeout_s}s"),
            timeout_s,
        )
        _REWARD_THREADS.replace_hung_worker()
        start = hung + 1


async def _timed_call(fn, prompt: str, completion: str, row: dict[str, Any], timeout_s: float):
    t0 = time.perf_counter()
    try:
        value: float | RewardFailure = await call_reward(fn, prompt, completion, row, timeout_s)
    except RewardFailure as failure:
        value = failure
    return value, time.perf_counter() - t0


class _BatchRun:
    """One worker thread's pass over a batch of sync reward calls, from ``start`` on."""

    def __init__(
        self, fn, calls: list, start: int, outcomes: dict, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.fn, self.calls, self.outcomes, self.loop = fn, calls, outcomes, loop
        self.index, self.item_started = start, None  # the item in progress (written by the worker)
        self.lock = threading.Lock()
        self.abandoned = False
        self.done = loop.create_future()

    def __call__(self) -> None:  # on the worker thread
        for i in range(self.index, len(self.calls)):
            with self.lock:
                if self.abandoned:
                    return
                self.index, self.item_started = i, time.monotonic()
            prompt, completion, row = self.calls[i]
            kwargs = {k: v for k, v in row.items() if k not in ("prompt", "completion")}
            t0 = time.perf_counter()
            try:
                value: Any = self.fn(prompt, completion, **kwargs)
            except (
                RewardFailure
            ) as failure:  # a reward list's part, or a TRL reward's reply, was refused
                value = failure
            except (Exception, SystemExit) as err:  # noqa: BLE001 - user code; sys.exit() must not kill the worker
                value = RewardFailure("raised", f"reward function raised {_describe(err)}")
            if not isinstance(value, RewardFailure):
                try:
                    value = check_value(value)
                except RewardFailure as failure:
                    value = failure
            with self.lock:
                if self.abandoned:  # the loop gave up on this item: its outcome is the timeout
                    return
                self.outcomes[i] = (value, time.perf_counter() - t0)
        try:
            self.loop.call_soon_threadsafe(lambda: self.done.done() or self.done.set_result(None))
        except RuntimeError:  # the loop closed meanwhile
            pass

    def abandon(self) -> bool:
        """Stop after the item in progress; True if one is in progress (its worker is lost)."""
        with self.lock:
            self.abandoned = True
            return self.item_started is not None and self.index not in self.outcomes

    async def wait(self, timeout_s: float) -> int | None:
        """None once every item has an outcome; else the index of an item that ran past
        ``timeout_s`` (this run is then abandoned). A run still queued after ``timeout_s``
        (every worker busy, maybe hung) gets a worker of its own."""
        added_worker = False
        while True:
            started = self.item_started
            remaining = timeout_s if started is None else started + timeout_s - time.monotonic()
            done, _ = await asyncio.wait({self.done}, timeout=max(remaining, 0.001))
            if done:
                return None
            if self.item_started is None:  # still queued a whole timeout later
                if not added_worker:
                    _REWARD_THREADS.replace_hung_worker()  # one more worker takes the queue on
                    added_worker = True
                continue
            with self.lock:
                index, started = self.index, self.item_started
                if (
                    started is not None
                    and index not in self.outcomes
                    and time.monotonic() - started >= timeout_s
                ):
                    self.abandoned = True
                    return index


async def _guarded(coro) -> tuple[str, Any]:
    """Await user code inside the task wait_for makes, so even a SystemExit becomes a
    result there (asyncio lets a SystemExit out of a task stop the whole loop)."""
    try:
        return "ok", await coro
    except RewardFailure as failure:
        return "failure", failure
    except (Exception, SystemExit) as err:  # noqa: BLE001 - user code: any error fails the rollout
        return "raised", err


# loomrl's own frames are left out of tracebacks
_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])


def _describe(err: BaseException) -> str:
    """``Type: message (at file:line in function)``, the innermost frame of the user's code,
    then that code's traceback on the following lines (the scorer logs it in full the first
    time a failure reason is seen). A reward list's part is named."""
    part = getattr(err, "name", None) if type(err).__name__ == "RewardPartError" else None
    if part is not None and err.__cause__ is not None:
        return f"(reward {part!r}) {_describe(err.__cause__)}"
    if isinstance(err, SystemExit):
        return f"SystemExit (it called sys.exit({err.code!r}); a reward must return a float)"
    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if not f.filename.startswith(_PACKAGE_DIR)
    ]
    if not frames:
        return f"{type(err).__name__}: {err}"
    last = frames[-1]
    return (
        f"{type(err).__name__}: {err} (at {last.filename}:{last.lineno} in {last.name})\n"
        "Traceback of the reward (most recent call last):\n"
        + "".join(traceback.format_list(frames)).rstrip()
    )
