"""Dynamic sampling (DAPO, arXiv 2503.14476): groups with nothing to learn from are dropped
as they are scored, and the generators keep producing until the step's batch is full.

A group whose rewards are all equal has zero advantage for every completion: training on it
moves no weight through the policy loss and dilutes the step's batch. With
``algorithm.dynamic_sampling`` such a group is dropped at intake: its rollouts are counted in
``rollout/dropped_zero_variance`` (a term of the accounting identity), its place at the
staleness gate is freed, so a generator starts another group in its stead, and its prompt is
set aside for the rest of the epoch (``PromptStream.set_aside_for_epoch``: not handed out
again, never trained, back in the next epoch's order; so no prompt is trained twice in an
epoch and none is resampled over and over while its group stays flat).

The bound: at most ``(max_oversampling - 1) x groups_per_step`` groups are dropped between
two batches taken. Past it no group is dropped until the next batch is taken, and that
batch is the groups the buffer holds as soon as it holds any (``RolloutBuffer.allow_short``):
the step trains on fewer groups than a batch, and ``after_take`` counts it in
``rollout/short_steps``, says so, and counts its empty places as taken at the gate.
"""

from __future__ import annotations

import logging
import math

from loomrl.config import JobConfig
from loomrl.control.buffer import Batch, RolloutBuffer, StalenessGate
from loomrl.data import PromptStream
from loomrl.types import Group

logger = logging.getLogger(__name__)


def has_zero_variance(group: Group) -> bool:
    """Every (successfully scored) rollout of ``group`` got the same reward."""
    return len(set(group.rewards)) <= 1


class DynamicSampling:
    def __init__(
        self,
        enabled: bool,
        max_oversampling: float,
        groups_per_step: int,
        stream: PromptStream,
        counters,
        buffer: RolloutBuffer,
        warn_every_steps: int = 20,
    ) -> None:
        self.enabled, self.max_oversampling = enabled, max_oversampling
        self.groups_per_step = groups_per_step
        self.warn_every_steps = warn_every_steps
        self.last_warned: int | None = None
        self.stream, self.counters, self.buffer = stream, counters, buffer
        # groups that may be dropped between two steps (at least one, for any factor > 1)
        self.max_drops = math.ceil(round((max_oversampling - 1) * groups_per_step, 9))
        self.dropped_since_step = 0
        self.dropped_rewards: list[list[float]] = []  # of the groups dropped since the last step

    @classmethod
    def of(cls, cfg: JobConfig | None, stream: PromptStream, counters, buffer: RolloutBuffer):
        """The filter of a job (``algorithm.dynamic_sampling``; off, or no job: a no-op)."""
        if cfg is None:
            return cls(False, 1.0, 1, stream, counters, buffer)
        algo = cfg.algorithm
        return cls(
            algo.dynamic_sampling,
            algo.max_oversampling,
            algo.groups_per_step,
            stream,
            counters,
            buffer,
            warn_every_steps=cfg.logging.zero_variance_warning_every_steps,
        )

    def keep(self, groups: list[Group]) -> list[Group]:
        """``groups`` (one request's, scored, without failed rollouts) less those dropped."""
        if not self.enabled:
            return groups
        kept = []
        for group in groups:
            if self.dropped_since_step < self.max_drops and has_zero_variance(group):
                self._drop(group)
            else:
                kept.append(group)
        return kept

    def _drop(self, group: Group) -> None:
        self.counters.dropped_zero_variance += group.size
        self.stream.set_aside_for_epoch(group.epoch, group.prompt_index)
        self.dropped_since_step += 1
        self.dropped_rewards.append(list(group.rewards))
        if self.dropped_since_step == self.max_drops:
            self.buffer.allow_short()

    async def after_take(self, step: int, batch: Batch, gate: StalenessGate) -> list[list[float]]:
        """Step ``step`` took ``batch``: the drop count starts again for the next step, and
        the rewards of the groups dropped for this one (for the zero-variance watch). A
        batch short of ``groups_per_step`` groups (the bound was spent) trains on what it
        has: its empty places count as taken at the gate, the step is counted in
        ``rollout/short_steps`` and said at most once every ``warn_every_steps`` steps."""
        missing = self.groups_per_step - len(batch.groups)
        if missing > 0:
            await gate.count_as_taken(missing)
            self._trained_short(step, len(batch.groups), missing)
        dropped, self.dropped_rewards = self.dropped_rewards, []
        self.dropped_since_step = 0
        return dropped

    def _trained_short(self, step: int, taken: int, missing: int) -> None:
        self.counters.short_steps += 1
        if self.last_warned is not None and step - self.last_warned < self.warn_every_steps:
            return
        self.last_warned = step
        logger.warning(
            "step %d trains on %d of %d groups: dynamic sampling dropped %d groups with the same "
            "reward for every completion since the last step, its bound (algorithm.max_oversampling"
            "=%g); rollout/short_steps counts such steps (said at most every %d steps)",
            step,
            taken,
            taken + missing,
            self.dropped_since_step,
            self.max_oversampling,
            self.warn_every_steps,
        )
