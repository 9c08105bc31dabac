"""A multi-turn environment task driven end to end by the controller with a tiny model."""

from __future__ import annotations

from loomrl.envs.base import Environment, StepResult
from loomrl.job import Job
from loomrl.models import build_char_tokenizer
from loomrl.telemetry.metrics import read_metrics
from loomrl.training.executor import TrainerExecutor


class GuessTwice(Environment):
    """Two turns: the first answer gets feedback, the second is scored on its length."""

    def __init__(self, bonus: float = 0.0) -> None:
        self.turn, self.bonus = 0, bonus

    def reset(self, row):
        return row["prompt"]

    def step(self, completion):
        self.turn += 1
        if self.turn == 1:
            return StepResult(observation=" again:", reward=0.0, done=False)
        return StepResult(
            observation="", reward=len(completion.strip()) / 3 + self.bonus, done=True
        )


class Broken(Environment):
    def reset(self, row):
        raise RuntimeError("environment backend down")

    def step(self, completion):  # pragma: no cover - never reached
        return StepResult("", 0.0, True)


def test_environment_job_runs_multi_turn_episodes_and_masks_observations(tiny_job, monkeypatch):
    trained: list = []
    real_step = TrainerExecutor.train_step

    def recording_step(self, groups, publish=False):
        trained.extend(r for g in groups for r in g)
        return real_step(self, groups, publish)

    monkeypatch.setattr(TrainerExecutor, "train_step", recording_step)
    cfg = tiny_job(
        task={
            "reward": None,
            "environment": "test_env_job:GuessTwice",
            "environment_args": {"bonus": 0.5},
            "max_turns": 3,
        },
        trainer={"num_steps": 2},
    )
    result = Job(cfg).run()
    tok = build_char_tokenizer()
    assert len(trained) == 2 * 4 * 4
    for r in trained:  # what the trainer got: the environment's tokens are masked out of the loss
        masked = [t for t, m in zip(r.completion_ids, r.loss_mask) if m == 0]
        assert r.num_turns == 2 and tok.decode(masked) == " again:"
        assert all(lp == 0.0 for lp, m in zip(r.behaviour_logprobs, r.loss_mask) if m == 0)
        assert sum(r.loss_mask) == len(r.completion_ids) - len(masked) > 0
    s = result.summary
    assert s["trained"] == 2 * 4 * 4 and s["failed"] == 0
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    steps = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert all(r["rollout/reward_mean"] >= 0.5 for r in steps)  # every episode reached turn 2
    assert result.eval_history and result.eval_history[-1]["eval/mean_reward"] >= 0.5


def test_environment_that_raises_fails_rollouts_and_stops_the_job(tiny_job):
    import pytest

    from loomrl.scoring.client import JobFailedError

    cfg = tiny_job(task={"reward": None, "environment": "test_env_job:Broken"})
    with pytest.raises(JobFailedError, match="environment backend down"):
        Job(cfg).run()


async def sandboxed_length(prompt, completion, **row):
    """Computes the reward inside the job's sandbox pool."""
    from loomrl.sandbox import default_pool

    result = await default_pool().aexec(f"print(len({completion!r}))", timeout_s=5.0)
    return float(result.stdout.strip()) / 3 if result.ok else 0.0


def test_sandboxed_reward_job_reports_pool_metrics(tiny_job):
    import json

    cfg = tiny_job(
        task={"reward": "test_env_job:sandboxed_length"},
        sandbox={"min_warm": 1, "max_warm": 2, "max_sandboxes": 4},
        trainer={"num_steps": 2},
    )
    result = Job(cfg).run()
    records = [r for r in read_metrics(result.run_dir) if "train/loss" in r]
    assert records[-1]["sandbox/exec_p50_ms"] > 0
    assert result.summary["failed"] == 0 and result.summary["trained"] == 2 * 4 * 4
    assert json.loads((result.run_dir / "config.json").read_text())["sandbox"]["max_warm"] == 2
