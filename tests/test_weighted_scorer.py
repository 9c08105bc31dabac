"""A reward model (or judge) and reward functions in one weighted ``[[task.rewards]]`` list
(loomrl.scoring.weighted): scored whole in the scorer executors, each part in its metrics."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest
from test_model_scorer import save_reward_model

from examples.arithmetic.reward import exact_match
from loomrl.config import ModelScorerConfig, TaskConfig
from loomrl.job import Job
from loomrl.scoring.executor import start_scorer_executor
from loomrl.scoring.model import RewardModelScorer
from loomrl.scoring.reward_list import load_reward
from loomrl.scoring.weighted import WeightedScorer
from loomrl.telemetry.metrics import read_metrics

pytestmark = pytest.mark.timeout(240)

EXACT = "examples.arithmetic.reward:exact_match"
ANSWERED = [("1+1=", "2", "2"), ("12+30=", "41", "42"), ("7+8=", "15", "15"), ("3+3=", "", "6")]


def parts(reward_model: str, **model) -> list[dict]:
    return [
        {"path": EXACT, "weight": 2.0},
        {"name": "rm", "weight": 0.5, "scorer": {"type": "model", "path": reward_model, **model}},
    ]


@pytest.fixture
def reward_model(tmp_path) -> str:
    return save_reward_model(tmp_path / "rm")


def test_a_list_with_a_reward_model_scores_the_weighted_sum_of_its_parts(reward_model):
    task = TaskConfig(rewards=parts(reward_model, device="cpu"))
    items = [(p, c, {"answer": a}) for p, c, a in ANSWERED]
    scorer = start_scorer_executor(task, None)
    try:
        assert isinstance(scorer, WeightedScorer)
        outcomes, metrics = scorer.score(items)
    finally:
        scorer.close()
    alone, _ = RewardModelScorer(ModelScorerConfig(path=reward_model, device="cpu")).score(items)
    model_scores = [value for _, value, _ in alone]
    exact = [exact_match(p, c, **row) for p, c, row in items]
    assert sum(exact) and not all(exact)  # both kinds of item
    assert [status for status, _, _ in outcomes] == ["ok"] * len(items)
    assert [value for _, value, _ in outcomes] == pytest.approx(
        [2.0 * e + 0.5 * m for e, m in zip(exact, model_scores)], abs=1e-6
    )
    n = float(len(items))
    assert metrics["reward/exact_match_count"] == metrics["reward/rm_count"] == n
    assert metrics["reward/exact_match_sum"] == sum(exact)
    assert metrics["reward/rm_sum"] == pytest.approx(sum(model_scores), abs=1e-5)
    assert metrics["scorer/model_items"] == n  # the model part's own metrics come along


def raises_on_seven(prompt: str, completion: str, **row) -> float:
    if "7" in prompt:
        raise ZeroDivisionError("seven")
    return 1.0


def test_a_failed_part_fails_the_item_with_the_part_named_and_is_not_in_the_means(reward_model):
    task = TaskConfig(
        rewards=[
            {"path": "test_weighted_scorer:raises_on_seven"},
            {"name": "rm", "scorer": {"type": "model", "path": reward_model, "device": "cpu"}},
        ]
    )
    scorer = WeightedScorer(task)
    try:
        outcomes, metrics = scorer.score(
            [("7+8=", "15", {}), ("x" * 500, "1", {}), ("1+1=", "2", {})]
        )
    finally:
        scorer.close()
    (s1, m1, _), (s2, m2, _), (s3, _, _) = outcomes
    assert s1 == "raised" and "'raises_on_seven'" in m1 and "ZeroDivisionError" in m1
    assert s2 == "too_long" and m2.startswith("reward 'rm': ") and s3 == "ok"
    assert metrics["reward/rm_count"] == metrics["reward/raises_on_seven_count"] == 1.0


def test_the_controller_loads_no_model_for_such_a_list_but_checks_its_functions(reward_model):
    fn = load_reward(TaskConfig(rewards=parts("/no/such/folder")))  # the model is not loaded here
    assert fn.reward_stats.names == ["exact_match", "rm"]
    with pytest.raises(RuntimeError, match="scored in scorer executors"):
        fn("1+1=", "2")
    with pytest.raises(Exception, match="no_such_module"):
        load_reward(TaskConfig(rewards=[{"path": "no_such_module:f"}, *parts(reward_model)[1:]]))


def test_a_list_entry_is_a_function_or_a_scorer_not_both():
    with pytest.raises(ValueError, match="exactly one of 'path'.*got both"):
        TaskConfig(rewards=[{"path": EXACT, "scorer": {"type": "model", "path": "rm"}}])
    with pytest.raises(ValueError, match="got neither"):
        TaskConfig(rewards=[{"weight": 1.0}])
    with pytest.raises(ValueError, match="signature='trl' is for a function"):
        TaskConfig(rewards=[{"signature": "trl", "scorer": {"type": "model", "path": "rm"}}])


@pytest.mark.parametrize("runtime", ["local", "process"])
def test_a_job_trains_with_a_reward_model_and_a_function_together(tiny_job, reward_model, runtime):
    cfg = tiny_job(
        runtime=runtime,
        task={"reward": None, "rewards": parts(reward_model, device="cpu")},
        algorithm={"max_staleness": 0},  # the rollouts scored since the last step are its batch
        trainer={"num_steps": 3},
    )
    result = Job(cfg).run()
    s = result.summary
    assert s["steps"] == 3 and not s.get("job_failed") and s["failed"] == 0
    assert s["trained"] == 3 * cfg.algorithm.groups_per_step * cfg.algorithm.group_size
    steps = [r for r in read_metrics(result.run_dir) if "reward/rm_mean" in r]
    assert steps, "each part's mean is logged"
    for r in steps:
        assert 0.0 <= r["reward/exact_match_mean"] <= 1.0
        total = 2.0 * r["reward/exact_match_mean"] + 0.5 * r["reward/rm_mean"]
        assert r["rollout/reward_mean"] == pytest.approx(total, abs=1e-4)
    assert any(abs(r["reward/rm_mean"]) > 1e-3 for r in steps)  # the model's scores, not zeros


def test_a_killed_weighted_scorer_is_replaced_and_no_rollout_is_lost_or_scored_twice(
    tiny_job, reward_model
):
    cfg = tiny_job(
        runtime="process",
        task={"reward": None, "rewards": parts(reward_model, device="cpu")},
        trainer={"num_steps": 4},
        checkpoint={"every_steps": 100},
        faults={"min_deadline_s": 3.0, "deadline_factor": 10.0},
    )
    killed = []

    def on_record(record):
        if record.get("step") == 2 and "train/loss" in record and not killed:
            (proc,) = [p for p in multiprocessing.active_children() if p.name == "loomrl-scorer0"]
            killed.append(proc.pid)
            os.kill(proc.pid, signal.SIGKILL)

    s = Job(cfg).run(on_record=on_record).summary
    assert killed and s["steps"] == 4 and not s.get("job_failed") and s["failed"] == 0
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    assert s["trained"] == 4 * cfg.algorithm.groups_per_step * cfg.algorithm.group_size
    assert s["prompts_trained_twice"] == 0
    faults = s["faults"]
    assert faults["executor/scorer_failures"] == 1 and faults["executor/scorer_restarts"] == 1
    assert faults["executor/rescored_rollouts"] > 0 and faults["executor/lost_rollouts"] == 0
    assert not multiprocessing.active_children()
