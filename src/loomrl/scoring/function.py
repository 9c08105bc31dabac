"""The function scorer: a task's reward function (``task.reward``, ``[[task.rewards]]`` of
functions, or ``[task.scorer] type = "function"``) run in a scorer executor.

The executors are placed by the runtime like generators (threads, processes or Ray
actors), each with its own sandbox pool, so environment work scales out with them.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import operator
import os
import threading
from itertools import repeat
from typing import Any

from loomrl.config_common import DataConfig
from loomrl.sandbox.config import SandboxConfig
from loomrl.sandbox.default import configure_default_pool, default_pool_metrics
from loomrl.scoring.base import ScoreItem, ScoreOutcome, ScorerEndpoints
from loomrl.scoring.calls import RewardFailure, UserCodeError, call_reward_batch
from loomrl.scoring.config import TaskConfig
from loomrl.scoring.reward_list import drain_stats, load_reward

_first, _second = operator.itemgetter(0), operator.itemgetter(1)


def function_task(task: TaskConfig) -> TaskConfig:
    """``task`` as a ``task.reward`` task: a ``[task.scorer] type = "function"`` table
    becomes ``task.reward = path`` (what the function scorer reads); others as they are."""
    if task.scorer is not None and task.scorer.type == "function":
        return task.model_copy(update={"reward": task.scorer.path, "scorer": None})
    return task


def reward_outcomes(done: list[tuple[Any, float]]) -> list[ScoreOutcome]:
    """``call_reward_batch``'s (value or RewardFailure, seconds) as outcomes; without a
    failure (the common case) with no Python frame per item."""
    values = list(map(_first, done))
    if not any(map(isinstance, values, repeat(RewardFailure))):
        return list(zip(repeat("ok"), values, map(_second, done)))
    return [
        ("ok", value, seconds)
        if not isinstance(value, RewardFailure)
        else (value.reason, str(value), seconds)
        for value, seconds in done
    ]


class FunctionScorer(ScorerEndpoints):
    """Runs the task's reward function; async ones on one event loop of its own (so a
    reward that keeps a client bound to its loop keeps working), sync ones on the reward
    worker threads, with ``call_reward_batch``'s timeouts either way."""

    def __init__(
        self,
        task: TaskConfig,
        sandbox: SandboxConfig | None = None,
        data: DataConfig | None = None,
    ) -> None:
        # The controller loaded it already: what fails here fails in this process only.
        try:
            self.fn = load_reward(function_task(task), data)
        except UserCodeError as err:
            raise UserCodeError(
                f"scorer executor {_this_executor()} cannot load the task's reward: {err}"
            ) from err
        self.timeout_s = task.reward_timeout_s
        if sandbox is not None:
            configure_default_pool(sandbox)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="loomrl-reward-loop", daemon=True
        )
        self._thread.start()
        # batches being scored (close() cancels them)
        self._pending: set = set()

    def score(self, items: list[ScoreItem]) -> tuple[list[ScoreOutcome], dict[str, float]]:
        batch = asyncio.run_coroutine_threadsafe(
            call_reward_batch(self.fn, items, self.timeout_s), self._loop
        )
        self._pending.add(batch)
        try:
            done = batch.result()
        finally:
            self._pending.discard(batch)
        return reward_outcomes(done), {**default_pool_metrics(), **drain_stats(self.fn)}

    def close(self) -> None:
        """Cancel the batches still scoring (a job that stops does not wait for a hung
        reward: its worker thread is left to it), then stop the loop."""
        for batch in list(self._pending):
            batch.cancel()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


def _this_executor() -> str:
    """This scorer executor for a message: ``'scorer0' (pid N)`` in a process the runtime
    named, else the pid."""
    name = multiprocessing.current_process().name
    named = f"{name.removeprefix('loomrl-')!r} " if name.startswith("loomrl-") else ""
    return f"{named}(pid {os.getpid()})"


def start_function_scorer(
    task: TaskConfig, sandbox: SandboxConfig | None, data: DataConfig | None = None
) -> FunctionScorer:
    """A function scorer executor (module-level, so a ``functools.partial`` of it pickles)."""
    return FunctionScorer(task, sandbox, data)
