"""The sharded trainer (``trainer.parallel.type = "fsdp2"``, ``loomrl.training.fsdp``): N
ranks on gloo make the single trainer's updates, and a lost rank restarts the job."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest

from loomrl.config import ConfigError
from loomrl.job import Job
from loomrl.telemetry.metrics import read_metrics
from loomrl.training.fsdp import shard_rollouts
from loomrl.types import Rollout

pytestmark = pytest.mark.timeout(240)

SYNC = {"algorithm": {"max_staleness": 0}, "task": {"reward": "test_job:length_reward"}}


def _rollout(prompt_len: int, completion_len: int) -> Rollout:
    return Rollout(
        prompt_index=0,
        prompt_ids=[1] * prompt_len,
        completion_ids=[2] * completion_len,
        behaviour_logprobs=[0.0] * completion_len,
        loss_mask=[1.0] * completion_len,
        version=0,
    )


def test_rollouts_are_shared_by_tokens_not_rows_and_deterministically():
    rollouts = [_rollout(2, n) for n in (1, 1, 40, 1, 1, 1, 1, 1)]
    shares = shard_rollouts(rollouts, 2)
    assert shares == [[2], [0, 1, 3, 4, 5, 6, 7]]  # 42 and 21 tokens, not 4 rows each (45 and 18)
    rollouts = [_rollout(2, n) for n in (10, 3, 7, 5, 8, 2)]
    shares = shard_rollouts(rollouts, 3)
    assert sorted(sum(shares, [])) == list(range(6))
    loads = [sum(4 + len(rollouts[i].completion_ids) - 2 for i in s) for s in shares]
    assert max(loads) - min(loads) <= 2
    assert shares == shard_rollouts(rollouts, 3) and all(s == sorted(s) for s in shares)
    assert shard_rollouts(rollouts[:1], 3) == [[0], [], []]


def test_fsdp2_on_the_local_runtime_is_a_config_error_naming_process(tiny_job):
    with pytest.raises((ConfigError, ValueError), match="runtime='process'"):
        tiny_job(trainer={"parallel": {"type": "fsdp2", "dp_shard": 2}})


def _steps(run_dir):
    return [
        (r["train/loss"], r["train/grad_norm"], r["rollout/reward_mean"], r["train/num_tokens"])
        for r in read_metrics(run_dir)
        if "train/loss" in r
    ]


def test_two_ranks_match_one_trainer_step_for_step(tiny_job, tmp_path):
    num_steps = 5
    common = {**SYNC, "runtime": "process", "weight_sync": {"codec": "delta"}}
    trainer = {"num_steps": num_steps, "micro_batch_size": 4}
    single = Job(tiny_job(**common, trainer=trainer, output_dir=str(tmp_path / "single"))).run()
    sharded = Job(
        tiny_job(
            **common,
            trainer={**trainer, "parallel": {"type": "fsdp2", "dp_shard": 2}},
            output_dir=str(tmp_path / "fsdp"),
        )
    ).run()
    want, got = _steps(single.run_dir), _steps(sharded.run_dir)
    assert len(want) == len(got) == num_steps and want[0][0] != 0.0
    for (loss, norm, reward, tokens), (loss2, norm2, reward2, tokens2) in zip(want, got):
        assert reward2 == reward and tokens2 == tokens  # the same rollouts, step for step
        # after step 1 the on-policy loss is ~1e-6, a cancellation of O(1) terms: fp32 rounding
        assert loss2 == pytest.approx(loss, rel=1e-5, abs=1e-7)
        assert norm2 == pytest.approx(norm, rel=1e-5)
    assert sharded.summary["trained"] == single.summary["trained"]
    assert (sharded.run_dir / "final" / "config.json").exists()
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_a_rank_killed_mid_job_restarts_the_job_from_its_checkpoint(tiny_job, tmp_path):
    cfg = tiny_job(
        **SYNC,
        runtime="process",
        trainer={"num_steps": 6, "parallel": {"type": "fsdp2", "dp_shard": 2}},
        checkpoint={"every_steps": 2},
        output_dir=str(tmp_path / "run"),
    )
    killed = []

    def kill_rank1(record):
        if record.get("step") == 3 and not killed:
            (rank,) = [
                p for p in multiprocessing.active_children() if p.name == "loomrl-trainer.rank1"
            ]
            os.kill(rank.pid, signal.SIGKILL)
            killed.append(rank.pid)

    result = Job(cfg).run(on_record=kill_rank1)
    assert killed
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert records[-1]["step"] == 6
    assert result.summary["faults"]["executor/trainer_restarts"] >= 1
    assert result.summary["prompts_trained_twice"] == 0
    assert not multiprocessing.active_children()


@pytest.mark.gpu
def test_one_nccl_rank_on_cuda_trains_like_the_single_trainer(tiny_job, tmp_path):
    """The CUDA path (NCCL, bf16_mixed's MixedPrecisionPolicy, per-parameter gathers, full
    state dicts) on one GPU: two NCCL ranks cannot share a device, so one rank."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    common = {
        **SYNC,
        "runtime": "process",
        "model": {"device": "cuda"},
        "checkpoint": {"every_steps": 2},
    }
    trainer = {"num_steps": 4, "micro_batch_size": 4, "precision": "bf16_mixed"}
    single = Job(tiny_job(**common, trainer=trainer, output_dir=str(tmp_path / "single"))).run()
    sharded = Job(
        tiny_job(
            **common,
            trainer={**trainer, "parallel": {"type": "fsdp2", "dp_shard": 1}},
            output_dir=str(tmp_path / "fsdp"),
        )
    ).run()
    want, got = _steps(single.run_dir), _steps(sharded.run_dir)
    assert len(got) == 4
    # bf16 compute: the first step (same weights, same rollouts) agrees to bf16's precision
    assert got[0][2] == want[0][2] and got[0][1] == pytest.approx(want[0][1], rel=2e-2)
    assert (sharded.run_dir / "final" / "config.json").exists()
