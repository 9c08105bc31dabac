"""The stall watchdog: warns when an executor call, or the whole loop, makes no progress,
and stops a job that has made no training step for ``no_step_timeout_s``.

For a single call it only warns (``stall_warning_s``); an executor that stops answering is
killed and replaced at its call's deadline (``loomrl.runtime.supervision``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)


class NoStepError(RuntimeError):
    """No training step completed for ``no_step_timeout_s``: the job stops with the reason."""


class StallWatchdog:
    """Counts and logs stalls; ``run`` is a background task of the controller.

    ``handles()``: the executors to watch (their ``calls``, ``name`` and ``where``);
    ``progress()``: where the run stands, for the no-step warning: ``(next step, steps in
    all, groups dropped as stale since the last step, rollouts in flight)``;
    ``stop_after_s``: raise ``NoStepError`` from ``run`` when no step completed for that long
    (None: never), naming ``last_failure()`` (the newest rollout failure, or None)."""

    def __init__(
        self,
        limit_s: float,
        handles: Callable[[], Iterable],
        progress: Callable[[], tuple[int, int, int, int]],
        stop_after_s: float | None = None,
        last_failure: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.limit_s, self.handles, self.progress = limit_s, handles, progress
        self.stop_after_s, self.last_failure = stop_after_s, last_failure
        self.stall_warnings = 0  # executor calls that ran past stall_warning_s
        self.no_step_warnings = 0  # times no step completed within stall_warning_s
        self.last_step_at = time.monotonic()
        self._warned: set[tuple[str, int]] = set()

    def step_done(self) -> None:
        self.last_step_at = time.monotonic()

    async def run(self) -> None:
        """Warn, once per call, when an executor call runs past ``stall_warning_s``, so a
        hung generator, trainer or weight sync shows up in the log instead of as silence."""
        period_s = min(5.0, self.limit_s / 4, (self.stop_after_s or self.limit_s) / 4)
        while True:
            await asyncio.sleep(period_s)
            self._warn_if_no_step()
            self._stop_if_no_step()
            for handle in self.handles():
                for call_id, method, seconds in handle.calls.running():
                    if seconds > self.limit_s and (handle.name, call_id) not in self._warned:
                        self._warned.add((handle.name, call_id))
                        self._warn_stalled_call(handle, method, seconds)

    def _warn_stalled_call(self, handle, method: str, seconds: float) -> None:
        self.stall_warnings += 1
        logger.warning(
            "%s (%s): %r has run for %.1f s, past stall_warning_s=%g; the job may "
            "be hung there (py-spy dump shows where)",
            handle.name,
            handle.where,
            method,
            seconds,
            self.limit_s,
        )

    def _warn_if_no_step(self) -> None:
        """Warn once per stall when no training step has completed for ``limit_s`` seconds."""
        idle_s = time.monotonic() - self.last_step_at
        step, num_steps, drops, in_flight = self.progress()
        key = ("no-step", step)
        if idle_s <= self.limit_s or key in self._warned:
            return
        self._warned.add(key)
        self.no_step_warnings += 1
        logger.warning(
            "no training step completed for %.1f s (step %d of %d; %d groups dropped as stale, %d "
            "rollouts in flight since the last step); longer than stall_warning_s=%g, the job may be stuck",
            idle_s,
            step,
            num_steps,
            drops,
            in_flight,
            self.limit_s,
        )

    def _stop_if_no_step(self) -> None:
        """Raise ``NoStepError`` when no step completed for ``stop_after_s`` seconds."""
        idle_s = time.monotonic() - self.last_step_at
        if self.stop_after_s is None or idle_s <= self.stop_after_s:
            return
        step, num_steps, drops, in_flight = self.progress()
        failure = self.last_failure()
        raise NoStepError(
            f"no training step completed for {idle_s:.0f} s, past no_step_timeout_s="
            f"{self.stop_after_s:g}: the job stops at step {step} of {num_steps} ({drops} groups "
            f"dropped as stale and {in_flight} rollouts in flight since the last step"
            + (f"; the last rollout failure: {failure}" if failure else "")
            + "); fix the cause (a reward that always fails? generators that never return?), "
            "or raise no_step_timeout_s"
        )
