"""The stall watchdog: warns when an executor call, or the whole loop, makes no progress.

A part of ``Controller`` (a mixin). It only warns (``stall_warning_s``); an executor that
stops answering is killed and replaced at its call's deadline (``loomrl.runtime.supervision``).
"""

from __future__ import annotations

import asyncio
import logging
import time

logger = logging.getLogger("loomrl.controller")  # the warnings read as the controller's, as before


class StallWatchdog:
    async def _stall_watchdog(self) -> None:
        """Warn, once per call, when an executor call runs past ``stall_warning_s``, so a
        hung generator, trainer or weight sync shows up in the log instead of as silence."""
        limit = self.cfg.stall_warning_s
        warned: set[tuple[str, int]] = set()
        while True:
            await asyncio.sleep(min(5.0, limit / 4))
            self._warn_if_no_step(limit, warned)
            for handle in (self.trainer, *self.generators, *self.scorer.executors):
                for call_id, method, seconds in handle.calls.running():
                    if seconds <= limit or (handle.name, call_id) in warned:
                        continue
                    warned.add((handle.name, call_id))
                    self.stall_warnings += 1
                    logger.warning(
                        "%s (%s): %r has run for %.1f s, past stall_warning_s=%g; the job may "
                        "be hung there (py-spy dump shows where)",
                        handle.name,
                        handle.where,
                        method,
                        seconds,
                        limit,
                    )

    def _warn_if_no_step(self, limit: float, warned: set) -> None:
        """Warn once per stall when no training step has completed for ``limit`` seconds."""
        idle_s = time.monotonic() - self._last_step_at
        key = ("no-step", self.version)
        if idle_s <= limit or key in warned:
            return
        warned.add(key)
        self.no_step_warnings += 1
        logger.warning(
            "no training step completed for %.1f s (step %d of %d; %d groups dropped as stale, %d "
            "rollouts in flight since the last step); longer than stall_warning_s=%g, the job may be stuck",
            idle_s,
            self.version + 1,
            self.cfg.trainer.num_steps,
            self._drops_since_step,
            self.in_flight,
            limit,
        )
