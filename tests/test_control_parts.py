"""The controller's parts on their own: a request's groups scored into the buffer (failed
rollouts left out, a group every scorer lost handed out again)."""

from __future__ import annotations

import asyncio

import pytest

from loomrl.control.background import Background
from loomrl.control.buffer import RolloutBuffer, StalenessGate
from loomrl.control.intake import Intake
from loomrl.control.requeues import Requeues
from loomrl.control.rollouts import Versions
from loomrl.control.step_record import Counters
from loomrl.runtime.supervision import FaultStats
from loomrl.scoring.base import SCORER_LOST
from loomrl.types import Group, Rollout


class MarkingScorer:
    """Scores each rollout by its completion: "ok", "bad" (the reward raised) or "lost"."""

    def __init__(self) -> None:
        self.recorded: list = []

    async def score_groups(self, groups, payload=None) -> None:
        for group in groups:
            for i, text in enumerate(group.texts):
                if text == "ok":
                    group.rewards[i] = 1.0
                elif text == "bad":
                    group.fail(i, "raised", "raised")
                else:
                    group.fail(i, "scorer_lost", f"{SCORER_LOST}: killed")

    def record_ok(self, count: int) -> None:
        self.recorded.append(count)

    def record_outcomes(self, outcomes) -> None:
        self.recorded.append([r.status for r in outcomes])


class Stream:
    def __init__(self) -> None:
        self.requeued: list[tuple[int, int]] = []

    def requeue(self, epoch: int, index: int) -> None:
        self.requeued.append((epoch, index))


def _group(index: int, completions: list[str]) -> Group:
    rollouts = [Rollout(index, [1], [5], [-1.0], [1], 0, "p", c) for c in completions]
    return Group.of_rollouts(index, 0, rollouts)


def test_intake_leaves_failed_rollouts_out_and_hands_out_again_a_group_every_scorer_lost():
    async def scenario():
        gate, buffer, counters, faults, stream = (
            StalenessGate(0, 3),
            RolloutBuffer(0),
            Counters(),
            FaultStats(),
            Stream(),
        )
        requeues = Requeues(stream, gate, counters, faults, Versions(0, 0, 0), 3)
        scorer = MarkingScorer()
        intake = Intake(scorer, buffer, gate, counters, requeues, Background())
        assert await gate.acquire(3) == 3
        groups = [_group(0, ["ok", "ok"]), _group(1, ["ok", "bad"]), _group(2, ["lost", "lost"])]
        intake.add(groups, 6)
        assert intake.in_flight == 6  # being scored
        await intake.settle(None)
        return gate, buffer, counters, faults, stream, scorer, intake

    gate, buffer, counters, faults, stream, scorer, intake = asyncio.run(scenario())
    assert counters.generated == 6 and counters.failed == 3
    assert [g.prompt_index for g in buffer.groups] == [0, 1] and buffer.num_rollouts == 3
    assert intake.in_flight == 3  # the kept rollouts, now in the buffer
    assert (gate.running, gate.accepted) == (0, 2)  # the lost group's place is free again
    assert stream.requeued == [(0, 2)] and faults.requeued_prompts == 1  # not the bad reward's
    # every outcome, ok or failed, goes to the failure-rate window once, in one call
    assert scorer.recorded == [["ok", "ok", "failed", "ok", "failed", "failed"]]


def test_intake_counts_an_episode_its_environment_failed_through_the_scorers_methods():
    """An environment task's episodes are not scored, but a failed one is counted by the
    scorer (``environment``) and its error is the one the failure-rate limit names."""
    import pytest

    from loomrl.scoring.client import JobFailedError, Scorer
    from loomrl.scoring.config import TaskConfig

    task = TaskConfig(environment="envs:Any", failure_window=2, max_failure_rate=0.4)
    scorer = Scorer(task)
    ok = Rollout(0, [1], [5], [-1.0], [1], 0, "p", "fine", reward=1.0)
    broken = Rollout(0, [1], [6], [-1.0], [1], 0, "p", "", status="failed")
    broken.error, broken.failure = "environment backend down", "environment"

    async def scenario():
        gate, counters, stream = StalenessGate(0, 1), Counters(), Stream()
        requeues = Requeues(stream, gate, counters, FaultStats(), Versions(0, 0, 0), 1)
        intake = Intake(scorer, RolloutBuffer(0), gate, counters, requeues, Background())
        assert await gate.acquire(1) == 1
        await intake.add_episodes(Group.of_rollouts(0, 0, [ok, broken]))

    with pytest.raises(JobFailedError, match="50% of the last 2.*environment backend down"):
        asyncio.run(scenario())
    assert scorer.failure_counts() == {"environment": 1}


def test_a_failure_ends_the_wait_for_a_batch_but_never_a_step_in_progress():
    # The training loop races failures only against its wait (until_failure): a step whose
    # trainer call runs is finished and counted first, then the failure is raised after it
    # (checked), so the checkpoint taken before the job fails matches the trainer's state.
    async def main():
        background, events = Background(), []

        async def fail_soon():
            await asyncio.sleep(0.01)
            raise RuntimeError("a generator died")

        async def step():  # not raced: runs to its end although the failure comes meanwhile
            await asyncio.sleep(0.05)
            events.append("step done")
            return "record"

        background.watch(asyncio.create_task(fail_soon()))
        with pytest.raises(RuntimeError, match="a generator died"):
            background.checked(await step())
        assert events == ["step done"]
        waiting = asyncio.sleep(10)  # the next wait for a batch ends at once
        with pytest.raises(RuntimeError, match="a generator died"):
            await background.until_failure(waiting)
        # with no failure, checked hands the value through
        assert Background().checked("record") == "record"

    asyncio.run(main())
