"""Rewards as a user brings them (issue 38, item 2): a weighted list of functions, each
logged on its own; TRL's batched signature; function objects given to Job; bools; a raising
reward's file and line in the log; a warning when groups have nothing to learn."""

from __future__ import annotations

import asyncio
import logging

import pytest

from loomrl.config import RewardSpec, TaskConfig
from loomrl.job import Job
from loomrl.scoring.calls import RewardFailure, call_reward_batch
from loomrl.scoring.reward_list import combine, is_trl_signature, load_reward
from loomrl.telemetry.metrics import read_metrics


def has_digits(prompt: str, completion: str, **row) -> bool:
    return any(c.isdigit() for c in completion)


def trl_length(prompts, completions, answer, **kwargs) -> list[float]:
    """A TRL reward function, unchanged: lists in, a list out; columns by name."""
    assert len(prompts) == len(completions) == len(answer) == 1
    return [len(c) / 10 for c in completions]


async def async_half(prompt: str, completion: str, **row) -> float:
    return 0.5


def raises_sometimes(prompt: str, completion: str, **row) -> float:
    if "+" in prompt and len(completion) % 2 == 0:
        raise ValueError(f"cannot score {completion!r}")  # the line the log names
    return 0.0


RAISE_LINE = raises_sometimes.__code__.co_firstlineno + 2


def _run(coro):
    return asyncio.run(coro)


def test_a_weighted_list_sums_its_parts_and_keeps_each_ones_values():
    specs = [
        RewardSpec(path="test_rewards_list:has_digits", weight=0.5, name="digits"),
        RewardSpec(path="test_rewards_list:trl_length", weight=2.0),
    ]
    fn = combine(specs)
    items = [("1+2=", "3", {"answer": "3"}), ("1+2=", "abcd", {"answer": "3"})]
    values = [v for v, _ in _run(call_reward_batch(fn, items, 2.0))]
    assert values == [0.5 * 1.0 + 2.0 * 0.1, 0.5 * 0.0 + 2.0 * 0.4]
    assert fn.reward_stats.drain() == {
        "reward/digits_sum": 1.0,
        "reward/trl_length_sum": 0.5,
        "reward/digits_count": 2.0,
        "reward/trl_length_count": 2.0,
        "reward/digits_none": 0.0,
        "reward/trl_length_none": 0.0,
    }
    assert fn.reward_stats.drain() == {}
    with_async = combine([*specs, RewardSpec(path="test_rewards_list:async_half", weight=1.0)])
    assert _run(call_reward_batch(with_async, items[:1], 2.0))[0][0] == pytest.approx(0.7 + 0.5)
    assert is_trl_signature(trl_length) and not is_trl_signature(has_digits)


def test_a_single_trl_reward_and_a_bool_reward_score_unchanged():
    trl = load_reward(TaskConfig(reward="test_rewards_list:trl_length"))
    assert _run(call_reward_batch(trl, [("p", "abc", {"answer": "1"})], 2.0))[0][
        0
    ] == pytest.approx(0.3)
    flag = load_reward(TaskConfig(reward="test_rewards_list:has_digits"))
    assert [v for v, _ in _run(call_reward_batch(flag, [("p", "7", {}), ("p", "x", {})], 2.0))] == [
        1.0,
        0.0,
    ]


def test_a_failing_part_fails_the_rollout_naming_the_part():
    def wrong_length(prompts, completions, **kwargs):
        return [1.0, 2.0]

    from loomrl.scoring.calls import callable_path

    fn = combine(
        [
            RewardSpec(path="test_rewards_list:has_digits"),
            RewardSpec(path=callable_path(wrong_length), name="bad"),
        ]
    )
    ((value, _),) = _run(call_reward_batch(fn, [("p", "1", {})], 2.0))
    assert isinstance(value, RewardFailure) and value.reason == "invalid"
    assert "reward 'bad'" in str(value) and "expected a list of one float" in str(value)
    raising = combine([RewardSpec(path="test_rewards_list:raises_sometimes", name="r")])
    ((value, _),) = _run(call_reward_batch(raising, [("1+1=", "ab", {})], 2.0))
    assert value.reason == "raised" and "(reward 'r') ValueError: cannot score 'ab'" in str(value)
    assert f"{__file__}:{RAISE_LINE} in raises_sometimes" in str(value)


def test_a_trl_reward_and_a_weighted_list_train_and_log_each_reward(tiny_job):
    cfg = tiny_job(
        algorithm={"max_staleness": 0}, trainer={"num_steps": 2}, eval={"every_steps": 100}
    )
    raw = cfg.model_dump()
    raw["task"]["reward"] = None
    job = Job(
        model=raw["model"]["path"],
        dataset=raw["data"]["train"],
        output_dir=raw["output_dir"],
        rewards=[
            {"path": has_digits, "weight": 0.5, "name": "digits"},
            {"path": trl_length, "weight": 2.0},
        ],
        group_size=4,
        groups_per_step=4,
        max_staleness=0,
        num_steps=2,
        overrides=["generation.max_new_tokens=3", f"model.path={raw['model']['path']!r}"],
    )
    # a function object, by its path
    assert job.config.task.rewards[1].path == "test_rewards_list:trl_length"
    result = job.run()
    records = [r for r in read_metrics(result.run_dir) if "rollout/reward_mean" in r]
    assert len(records) == 2
    for r in records:
        assert 0 <= r["reward/digits_mean"] <= 1 and 0 < r["reward/trl_length_mean"] <= 0.3
        # Synchronous: the rollouts scored since the last step are the step's batch.
        assert r["rollout/reward_mean"] == pytest.approx(
            0.5 * r["reward/digits_mean"] + 2 * r["reward/trl_length_mean"]
        )


def test_a_lambda_reward_runs_locally_and_is_refused_for_other_processes(tiny_job, tiny_data):
    train, _ = tiny_data
    job = Job(
        model="tiny:llama?hidden_size=32&num_layers=2&num_heads=2&intermediate_size=64",
        dataset=str(train),
        reward=lambda prompt, completion, **row: completion.startswith("1"),
        num_steps=1,
        group_size=2,
        groups_per_step=2,
        output_dir=str(train.parent / "lambda-run"),
        overrides=["generation.max_new_tokens=2"],
    )
    assert job.config.task.reward.startswith("loomrl.registered:")
    assert job.run().summary["steps"] == 1
    with pytest.raises(ValueError, match="not importable by path .*runtime='process'"):
        Job(dataset=str(train), reward=lambda p, c, **r: 1.0, runtime="process")


def test_a_raising_reward_shows_its_file_and_line_once_with_its_traceback(tiny_job, caplog):
    cfg = tiny_job(
        task={"reward": "test_rewards_list:raises_sometimes", "max_failure_rate": 1.0},
        trainer={"num_steps": 2},
    )
    with caplog.at_level(logging.WARNING, logger="loomrl.scoring.client"):
        result = Job(cfg).run()
    assert result.summary["steps"] == 2
    failures = [
        r.getMessage() for r in caplog.records if "rollout failed scoring" in r.getMessage()
    ]
    assert failures and f"{__file__}:{RAISE_LINE} in raises_sometimes" in failures[0]
    assert (
        "Traceback of the reward" in failures[0]
        and 'raise ValueError(f"cannot score' in failures[0]
    )
    assert all("Traceback" not in message for message in failures[1:])  # the later ones: one line
    # and in summary.json
    assert f"{__file__}:{RAISE_LINE}" in result.summary["first_failures"]["raised"]


def test_the_zero_variance_warning_fires_on_a_random_model(tiny_job, caplog):
    """A random tiny model never answers an exact-match arithmetic prompt: every group is all zeros."""
    cfg = tiny_job(trainer={"num_steps": 3}, logging={"zero_variance_warning_every_steps": 2})
    with caplog.at_level(logging.WARNING, logger="loomrl.telemetry.samples"):
        result = Job(cfg).run()
    records = [r for r in read_metrics(result.run_dir) if "rollout/zero_variance_frac" in r]
    assert [r["rollout/zero_variance_frac"] for r in records] == [1.0, 1.0, 1.0]
    warnings = [r.getMessage() for r in caplog.records if "nothing to learn" in r.getMessage()]
    assert len(warnings) == 2 and warnings[0].startswith("step 1: 4 of 4 groups")  # steps 1 and 3
