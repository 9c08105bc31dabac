"""When the controller checkpoints: every ``checkpoint.every_steps``, at the end, at a stop,
and before a failure that left the trainer alive (so a job that fails keeps what it trained)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from loomrl.config import JobConfig
from loomrl.control.step_record import RunClock
from loomrl.runtime.supervision import TrainerLostError

logger = logging.getLogger(__name__)


class Checkpoints:
    """``save(version)`` writes a checkpoint of ``version`` (the session's, set by the
    controller's ``run``; None: no checkpoints); ``last`` is the newest version written (a
    resumed run starts at one)."""

    def __init__(self, cfg: JobConfig, last: int, history: dict[str, Any]) -> None:
        self.save: Callable[[int], Awaitable[Any]] | None = None
        self.last, self.history = last, history
        self.every_steps, self.num_steps = cfg.checkpoint.every_steps, cfg.trainer.num_steps

    def due(self, version: int, stopping: bool) -> bool:
        """Whether the step that made ``version`` is to be kept now."""
        return self.save is not None and (
            version % self.every_steps == 0 or version == self.num_steps or stopping
        )

    async def if_new(self, version: int, clock: RunClock) -> None:
        """Checkpoint ``version`` unless it is kept already."""
        if self.save is not None and version > self.last:
            self.history["elapsed_s_at_checkpoint"] = clock.elapsed()
            await self.save(version)
            self.last = version

    async def before_failure(self, version: int, clock: RunClock, err: BaseException) -> None:
        """The job is failing with ``err`` while the trainer may live (a generator or scorer
        died): keep what it trained, if anything is new (a lost trainer took its state)."""
        if self.save is None or version <= self.last or isinstance(err, TrainerLostError):
            return
        try:
            await self.if_new(version, clock)
        except Exception as ckpt_err:  # noqa: BLE001 - the trainer is gone too: report the first error
            logger.error("could not checkpoint step %d after %r: %r", version, err, ckpt_err)
        else:
            logger.warning(
                "job failing (%s); checkpointed step %d first, `loomrl resume` continues",
                err,
                version,
            )
