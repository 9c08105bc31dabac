"""``loomrl resume RUN KEY=VALUE`` trains with the overridden optimizer and schedule keys
from its first step: the optimizer and scheduler state restored from the checkpoint keep
their moments and step count, not the old learning rate, betas, weight decay or schedule;
the clip norm and the KL coefficient are the new config's too."""

from __future__ import annotations

import shutil

import pytest

from loomrl.config import build_config
from loomrl.job import Job, resume_job
from loomrl.telemetry.metrics import read_metrics
from loomrl.training.checkpoint import latest_checkpoint, load_checkpoint

from conftest import tiny_job_raw

LR = 1e-3


def varied_reward(prompt, completion, **row):
    """A reward that differs between almost any two completions."""
    return float(sum(map(ord, completion)) % 17)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A synchronous two-step run with a checkpoint at step 2 (lr 1e-3, constant, no KL)."""
    tmp = tmp_path_factory.mktemp("resume_applies")
    train = tmp / "train.jsonl"
    train.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(64)))
    raw = tiny_job_raw(
        tmp,
        train,
        algorithm={"max_staleness": 0, "group_size": 4, "groups_per_step": 2},
        trainer={"num_steps": 2, "lr": LR, "micro_batch_size": 8},
        # varies with the completion: advantages, and gradients, are not zero
        task={"reward": "test_resume_applies:varied_reward"},
    )
    return Job(build_config(raw)).run().run_dir


def resumed(saved_run, tmp_path, *overrides: str) -> dict[int, dict]:
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    resume_job(run, overrides=list(overrides))
    return {r["step"]: r for r in read_metrics(run) if "train/loss" in r}


def test_a_new_learning_rate_trains_from_the_first_resumed_step(saved_run, tmp_path):
    steps = resumed(saved_run, tmp_path, "trainer.lr=1e-5", "trainer.num_steps=3")
    assert steps[2]["train/lr"] == LR
    assert steps[3]["train/lr"] == 1e-5


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # linear decay to 0 at step 4: the third step (scheduler step 2) at half
        (["trainer.lr_schedule='linear'", "trainer.num_steps=4"], LR * (1 - 2 / 4)),
        # a warmup of 4 steps: the third step at 3/4
        (["trainer.warmup_steps=4", "trainer.num_steps=3"], LR * 3 / 4),
    ],
)
def test_a_new_schedule_applies_at_the_restored_step(saved_run, tmp_path, overrides, expected):
    steps = resumed(saved_run, tmp_path, *overrides)
    assert steps[3]["train/lr"] == pytest.approx(expected, rel=1e-12)


def test_new_betas_and_weight_decay_reach_the_restored_optimizer(saved_run, tmp_path):
    resumed(
        saved_run,
        tmp_path,
        "trainer.betas=[0.5, 0.75]",
        "trainer.weight_decay=0.25",
        "trainer.num_steps=4",
    )
    state = load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    groups = state["trainer"]["optimizer"]["param_groups"]
    assert {tuple(g["betas"]) for g in groups} == {(0.5, 0.75)}
    assert {g["weight_decay"] for g in groups} == {0.25}
    assert {g["initial_lr"] for g in groups} == {LR}
    # and the moments were kept: AdamW's step count goes on from the checkpoint's
    steps = {int(s["step"]) for s in state["trainer"]["optimizer"]["state"].values()}
    assert steps == {4}


def test_a_kl_coefficient_set_on_resume_penalises_from_the_first_step(saved_run, tmp_path):
    steps = resumed(saved_run, tmp_path, "algorithm.kl_coef=0.5", "trainer.num_steps=3")
    assert "train/kl" not in steps[2]
    assert steps[3]["train/kl"] >= 0.0


def test_a_new_clip_norm_clips_the_first_resumed_step(saved_run, tmp_path):
    # no first moment (beta1 0): the update is this step's (clipped) gradient over the
    # second moment of the unclipped ones before it
    common = ["trainer.num_steps=3", "trainer.betas=[0.0, 0.999]"]
    plain = resumed(saved_run, tmp_path / "a", *common)
    clipped = resumed(saved_run, tmp_path / "b", "trainer.max_grad_norm=1e-9", *common)
    # the same batch (synchronous, same seed): the same gradient before clipping
    assert plain[3]["train/grad_norm"] == clipped[3]["train/grad_norm"] > 1e-6
    # clipped to 1e-9: a far smaller update
    assert clipped[3]["train/update_rms"] < plain[3]["train/update_rms"] / 10
