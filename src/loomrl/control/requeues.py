"""Requeues: prompts handed out again, each once, when their work was lost or thrown away.

Three ways a dispatched prompt comes back: its generate call was lost with its generator
(now replaced), every rollout of its group was lost with its scorers, or its group grew too
stale in the buffer to train on. Each frees its place at the gate and is counted
(``executor/requeued_prompts``, ``rollout/dropped_stale``).
"""

from __future__ import annotations

from loomrl.control.buffer import StalenessGate
from loomrl.control.rollouts import Versions
from loomrl.data import PromptStream
from loomrl.runtime.supervision import ExecutorLostError, FaultStats
from loomrl.scoring.client import JobFailedError
from loomrl.types import Group


class Requeues:
    def __init__(
        self,
        stream: PromptStream,
        gate: StalenessGate,
        counters,
        faults: FaultStats,
        versions: Versions,
        groups_per_step: int,
    ) -> None:
        self.stream, self.gate, self.counters, self.faults = stream, gate, counters, faults
        self.versions = versions
        # Groups dropped as stale without a step between them past which the job fails:
        # the generators are then not getting new weights.
        self.max_drops_in_a_row = (versions.max_staleness + 10) * groups_per_step
        self.drops_since_step = 0  # groups dropped as stale since the last completed step

    async def lost_generate(self, picks: list[tuple[int, int]], err: ExecutorLostError) -> None:
        """The generate call of ``picks`` was lost with its generator: hand each prompt out
        again, once, and free its place at the gate (a generator not replaced fails the job)."""
        if not err.restarted:
            raise err
        for epoch, index in picks:
            self.stream.requeue(epoch, index)
            await self.gate.finish(accepted=False)
        self.faults.requeued_prompts += len(picks)

    def lost_scoring(self, group: Group) -> None:
        """Scorers lost every rollout of ``group`` (not the reward): its prompt goes out again."""
        self.stream.requeue(group.epoch, group.prompt_index)
        self.faults.requeued_prompts += 1

    async def stale(self, group: Group) -> None:
        """The buffer dropped ``group`` as too stale to train on now: count it, hand its
        prompt out again and free its place at the gate."""
        self.counters.dropped_stale += group.size
        self.stream.requeue(group.epoch, group.prompt_index)
        await self.gate.release_accepted()
        self.drops_since_step += 1
        if self.drops_since_step > self.max_drops_in_a_row:
            raise JobFailedError(
                f"{self.drops_since_step} groups in a row were dropped as too stale without one "
                f"training step (trainer at version {self.versions.trained}, newest dropped group from version "
                f"{group.min_version}): the generators are not getting new weights; check "
                "weight_sync (transport, sync_every) and the generator's log"
            )
