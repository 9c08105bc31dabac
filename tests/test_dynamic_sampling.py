"""Dynamic sampling: groups with nothing to learn from are dropped at intake and counted in
the accounting identity, their prompts set aside for the epoch, the generators keep going
until the batch is full, and the oversampling bound ends a step short, saying so."""

from __future__ import annotations

import asyncio
import logging

import pytest
from test_controller import RecordingTrainer, run_fake

from loomrl import Job
from loomrl.control.buffer import Batch, RolloutBuffer, StalenessGate
from loomrl.control.dynamic_sampling import DynamicSampling
from loomrl.control.step_record import Counters
from loomrl.data import PromptStream
from loomrl.telemetry.metrics import read_metrics
from loomrl.telemetry.samples import ZeroVarianceWatch
from loomrl.types import Group, Rollout


def half_flat(prompt: str, completion: str, **row) -> float:
    """1 for every completion of a prompt whose first digit is even (an all-right group),
    else a reward that varies with the completion."""
    if int(prompt[0]) % 2 == 0:
        return 1.0
    return float(sum(map(ord, completion)) % 2)


def always_one(prompt: str, completion: str, **row) -> float:
    return 1.0


def _identity(s: dict) -> bool:
    parts = ("trained", "dropped_stale", "dropped_zero_variance", "failed", "in_flight")
    return s["generated"] == sum(s[k] for k in parts)


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_only_groups_with_reward_variance_are_trained(tiny_job, tmp_path, max_staleness):
    cfg = tiny_job(
        task={"reward": "test_dynamic_sampling:half_flat"},
        algorithm={
            "dynamic_sampling": True,
            "max_oversampling": 20.0,
            "max_staleness": max_staleness,
            "groups_per_step": 3,
        },
        trainer={"num_steps": 6},
    )
    ctl, trainer, summary = run_fake(cfg, tmp_path, [0.0], [0.0], trainer_cls=RecordingTrainer)
    assert len(trainer.groups) == 6 * 3  # every step a full batch
    assert all(len(set(g.rewards)) > 1 for g in trainer.groups)
    assert summary["dropped_zero_variance"] > 0 and summary["short_steps"] == 0
    assert _identity(summary) and summary["prompts_trained_twice"] == 0
    # a dropped prompt is set aside for the epoch: never handed out again, never trained
    stream = ctl.stream
    assert summary["dropped_zero_variance"] == len(stream.set_aside) * cfg.algorithm.group_size
    assert not set(stream.set_aside) & {g.prompt_index for g in trainer.groups}
    assert len(set(stream.set_aside)) == len(stream.set_aside)


def test_the_bound_trains_a_step_short_and_says_so(tiny_job, tmp_path, caplog):
    # every group is flat; 1.5 x 2 groups a step: one group dropped, then what there is
    cfg = tiny_job(
        task={"reward": "test_dynamic_sampling:always_one"},
        algorithm={
            "dynamic_sampling": True,
            "max_oversampling": 1.5,
            "max_staleness": 0,
            "groups_per_step": 2,
        },
        trainer={"num_steps": 4},
        logging={"zero_variance_warning_every_steps": 1},
    )
    with caplog.at_level(logging.WARNING, logger="loomrl.control.dynamic_sampling"):
        ctl, trainer, summary = run_fake(cfg, tmp_path, [0.0], [0.0], trainer_cls=RecordingTrainer)
    assert summary["steps"] == 4 and summary["short_steps"] >= 1
    assert len(trainer.groups) < 4 * 2
    assert summary["dropped_zero_variance"] == 4 * cfg.algorithm.group_size  # one per step
    assert _identity(summary) and summary["prompts_trained_twice"] == 0
    said = [r.getMessage() for r in caplog.records if "dynamic sampling dropped" in r.getMessage()]
    assert said and "of 2 groups" in said[0] and "max_oversampling=1.5" in said[0]


def test_a_dynamic_sampling_job_on_the_tiny_model(tiny_job):
    cfg = tiny_job(
        task={"reward": "test_dynamic_sampling:half_flat"},
        algorithm={"dynamic_sampling": True, "max_oversampling": 20.0, "loss": "gspo"},
        trainer={"num_steps": 3},
    )
    result = Job(cfg).run()
    s = result.summary
    assert s["steps"] == 3 and s["dropped_zero_variance"] > 0 and s["short_steps"] == 0
    assert _identity(s) and s["prompts_trained_twice"] == 0
    steps = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert [r["rollout/zero_variance_trained_frac"] for r in steps] == [0.0] * 3
    assert all(r["train/num_rollouts"] == 16 for r in steps)
    rollouts = [
        {k[len("rollout/") :]: v for k, v in r.items() if k.startswith("rollout/")} for r in steps
    ]
    assert all(map(_identity, rollouts))


def _group(index: int, rewards: list[float]) -> Group:
    rows = [Rollout(index, [1], [5], [-1.0], [1], 0, reward=r) for r in rewards]
    return Group.of_rollouts(index, 0, rows)


def test_the_filter_counts_sets_aside_and_stops_at_its_bound():
    stream, counters, buffer = PromptStream(10, 0), Counters(), RolloutBuffer(1)
    picks = stream.next_many(5)
    zv = DynamicSampling(True, 2.0, 2, stream, counters, buffer)  # at most 2 dropped a step
    groups = [_group(i, r) for (_, i), r in zip(picks, [[1, 1], [0, 1], [0, 0], [1, 1], [0, 1]])]
    kept = zv.keep(groups)
    # the first two flat groups are dropped; the third flat one is past the bound
    assert [g.prompt_index for g in kept] == [picks[1][1], picks[3][1], picks[4][1]]
    assert counters.dropped_zero_variance == 4 and stream.set_aside == [picks[0][1], picks[2][1]]

    # the bound was reached: the next take returns what the buffer holds, and the step
    # taking a full batch hands over the dropped groups' rewards and starts the count again
    async def take_short():
        await buffer.put_many(kept[:1])
        return await buffer.take(2, 0, None)

    assert len(asyncio.run(take_short()).groups) == 1
    gate = StalenessGate(0, 2)
    dropped = asyncio.run(zv.after_take(1, Batch(kept[:2]), gate))
    assert dropped == [[1.0, 1.0], [0.0, 0.0]] and zv.dropped_since_step == 0
    assert counters.short_steps == 0 and gate.accepted == 0
    # a short batch counts its empty place as taken at the gate and as a short step
    asyncio.run(zv.after_take(2, Batch(kept[:1]), gate))
    assert counters.short_steps == 1 and gate.accepted == 1
    # the rest of the epoch never hands the set-aside prompts out again
    rest = [i for _, i in stream.next_many(5)]
    assert not set(rest) & set(stream.set_aside)
    off = DynamicSampling(False, 2.0, 2, stream, counters, buffer)
    assert off.keep(groups) == groups


def test_the_warning_tells_all_wrong_from_all_right_groups(caplog):
    watch = ZeroVarianceWatch(every_steps=1)
    with caplog.at_level(logging.WARNING, logger="loomrl.telemetry.samples"):
        # a model that has learnt the task: 3 of 4 groups all right, 1 with some variance
        got = watch.observe(1, [[1, 1], [1, 1], [0, 1], [1, 1]])
        # a model that cannot do it: all wrong (lowest reward seen: 0)
        got_wrong = watch.observe(2, [[0, 0], [0, 0], [0, 0], [1, 1]])
    assert got["rollout/zero_variance_right_frac"] == 0.75
    assert got["rollout/zero_variance_wrong_frac"] == 0.0
    assert got_wrong["rollout/zero_variance_wrong_frac"] == 0.75
    assert got_wrong["rollout/zero_variance_right_frac"] == 0.25
    right, wrong = (r.getMessage() for r in caplog.records)
    assert right.startswith("step 1: 3 of 4 groups had the same reward for every completion")
    assert "3 all right (75%" in right and "too easy" in right and "dynamic_sampling" in right
    assert "warm-start" not in right
    assert wrong.index("3 all wrong (75%") < wrong.index("1 all right (25%")
    assert "warm-start" in wrong
