"""Loading user code by import path, and scoring with a timeout.

A reward function is ``fn(prompt, completion, **row) -> float``, sync or async. A call that
raises, returns something that is not a finite number, or runs past its timeout marks the
rollout failed (counted, never trained on). A sync function that hangs cannot be stopped
from Python: it is left running in a daemon thread and counted under ``timeout``; code
that must be stopped belongs in a sandbox (``loomrl.sandbox``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import queue
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


class UserCodeError(ValueError):
    """An import path that names nothing callable."""


def load_object(path: str) -> Any:
    """``'package.module:name'`` -> the object. The working directory is importable."""
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
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UserCodeError(f"module {module_name!r} has no attribute {attr!r}") from None


class RewardFailure(Exception):
    """A reward call that cannot score the rollout; ``reason`` is one of raised/invalid/timeout."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _check_value(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardFailure("invalid", f"reward function returned {value!r}, expected a float")
    value = float(value)
    if not math.isfinite(value):
        raise RewardFailure("invalid", f"reward function returned non-finite {value}")
    return value


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
            self._tasks.get()()

    def _spawn(self) -> None:
        threading.Thread(target=self._work, name="reward", daemon=True).start()
        self._started += 1

    def submit(self, task: Callable[[], None]) -> None:
        with self._lock:
            while self._started < self._size:
                self._spawn()
        self._tasks.put(task)

    def replace_hung_worker(self) -> None:
        with self._lock:
            self._size += 1
            self._spawn()


_REWARD_THREADS = DaemonThreads()


async def call_reward(
    fn: Callable[..., Any], prompt: str, completion: str, row: dict[str, Any], timeout_s: float
) -> float:
    """Score one completion; raises ``RewardFailure`` on any failure."""
    kwargs = {k: v for k, v in row.items() if k not in ("prompt", "completion")}
    if inspect.iscoroutinefunction(fn):
        try:
            status, value = await asyncio.wait_for(_guarded(fn(prompt, completion, **kwargs)), timeout_s)
        except TimeoutError:
            raise RewardFailure("timeout", f"reward function took longer than {timeout_s}s") from None
        if status == "raised":
            raise RewardFailure("raised", f"reward function raised {_describe(value)}")
        return _check_value(value)
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def target() -> None:
        try:
            result: Any = ("ok", fn(prompt, completion, **kwargs))
        except (Exception, SystemExit) as err:  # noqa: BLE001 - user code; sys.exit() must not kill the worker
            result = ("raised", err)
        try:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))
        except RuntimeError:  # the loop closed while a timed-out call was still running
            pass

    _REWARD_THREADS.submit(target)
    try:
        status, value = await asyncio.wait_for(future, timeout_s)
    except TimeoutError:
        _REWARD_THREADS.replace_hung_worker()
        raise RewardFailure("timeout", f"reward function took longer than {timeout_s}s") from None
    if status == "raised":
        raise RewardFailure("raised", f"reward function raised {_describe(value)}")
    return _check_value(value)


async def _guarded(coro) -> tuple[str, Any]:
    """Await user code inside the task wait_for makes, so even a SystemExit becomes a
    result there (asyncio lets a SystemExit out of a task stop the whole loop)."""
    try:
        return "ok", await coro
    except (Exception, SystemExit) as err:  # noqa: BLE001 - user code: any error fails the rollout
        return "raised", err


def _describe(err: BaseException) -> str:
    if isinstance(err, SystemExit):
        return f"SystemExit (it called sys.exit({err.code!r}); a reward must return a float)"
    return f"{type(err).__name__}: {err}"
