"""Hostile reward values (issue 41, finding 6): a reward that returns a number the trainer
cannot hold (beyond fp32, a bigint that overflows float(), inf, nan) fails its rollout as a
counted scoring failure with the value in the message, at once: never a crash, a raw
traceback or a timeout, sync or async, and the job's accounting still adds up."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from loomrl.envs.base import Environment, StepResult
from loomrl.job import Job
from loomrl.scoring.calls import RewardFailure, call_reward, call_reward_batch

pytestmark = pytest.mark.timeout(120)

HOSTILE = [10**400, -(10**400), 1e39, -1e39, 3.5e38, 2**128]


def _sync(value):
    return lambda prompt, completion, **row: value


def _async(value):
    async def reward(prompt, completion, **row):
        return value

    return reward


@pytest.mark.parametrize("make", [_sync, _async], ids=["sync", "async"])
@pytest.mark.parametrize(
    "value", HOSTILE, ids=lambda v: f"{v:.3g}" if isinstance(v, float) else f"int{v.bit_length()}b"
)
def test_an_out_of_range_reward_is_a_counted_failure_at_once(make, value):
    t0 = time.perf_counter()
    with pytest.raises(RewardFailure, match="out of range") as info:
        asyncio.run(call_reward(make(value), "p", "c", {}, timeout_s=5.0))
    assert info.value.reason == "out_of_range"  # not "timeout", not an OverflowError
    assert time.perf_counter() - t0 < 1.0
    text = str(info.value)
    assert len(text) < 300  # a 400-digit number is described, not printed
    if isinstance(value, float):
        assert f"{value}" in text
    else:
        assert f"{value.bit_length()}-bit" in text


@pytest.mark.parametrize("make", [_sync, _async], ids=["sync", "async"])
def test_a_batch_with_hostile_values_scores_the_rest(make):
    values = [1.0, 10**400, 0.5, 1e39, float("inf"), float("nan"), 3.4e38, -2.0]

    def pick(prompt, completion, **row):
        return values[row["i"]]

    async def apick(prompt, completion, **row):
        return values[row["i"]]

    fn = pick if make is _sync else apick
    t0 = time.perf_counter()
    done = asyncio.run(
        call_reward_batch(fn, [("p", "c", {"i": i}) for i in range(len(values))], 5.0)
    )
    assert time.perf_counter() - t0 < 2.0
    outcomes = [v if not isinstance(v, RewardFailure) else v.reason for v, _ in done]
    assert outcomes == [
        1.0,
        "out_of_range",
        0.5,
        "out_of_range",
        "invalid",
        "invalid",
        3.4e38,
        -2.0,
    ]
    # the reward's worker threads survived: the next batch is scored as usual
    assert [
        v for v, _ in asyncio.run(call_reward_batch(pick, [("p", "c", {"i": 0})] * 4, 5.0))
    ] == [1.0] * 4


def bigint_on_odd_answers(prompt: str, completion: str, answer: str, **row) -> float:
    return 10**400 if int(answer) % 2 else 1.0


async def async_bigint_on_odd_answers(prompt: str, completion: str, answer: str, **row) -> float:
    return 10**400 if int(answer) % 2 else 1.0


def fp32_overflow_on_odd_answers(prompt: str, completion: str, answer: str, **row) -> float:
    return 1e39 if int(answer) % 2 else 1.0


@pytest.mark.parametrize(
    "reward",
    ["bigint_on_odd_answers", "async_bigint_on_odd_answers", "fp32_overflow_on_odd_answers"],
)
def test_a_job_with_hostile_rewards_completes_and_its_accounting_adds_up(tiny_job, reward, caplog):
    cfg = tiny_job(
        task={"reward": f"test_hostile_values:{reward}", "max_failure_rate": 1.0},
        trainer={"num_steps": 2},
    )
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="loomrl.scoring.client"):
        result = Job(cfg).run()
    s = result.summary
    assert s["steps"] == 2 and not s.get("job_failed")
    assert s["failed"] > 0
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
    assert time.perf_counter() - t0 < 60  # no reward timeout paid per failure
    assert "out of range" in caplog.text  # the value is in the log


class HugeOnOddAnswers(Environment):
    """One turn; an odd answer's step returns a reward no float can hold."""

    def reset(self, row):
        self.answer = int(row["answer"])
        return row["prompt"]

    def step(self, completion):
        return StepResult(observation="", reward=10**400 if self.answer % 2 else 1.0, done=True)


def test_an_environment_step_reward_out_of_range_fails_its_episode_not_the_job(tiny_job):
    cfg = tiny_job(
        task={
            "reward": None,
            "environment": "test_hostile_values:HugeOnOddAnswers",
            "max_failure_rate": 1.0,
        },
        trainer={"num_steps": 2},
    )
    result = Job(cfg).run()
    s = result.summary
    assert s["steps"] == 2 and not s.get("job_failed")
    assert s["failed"] > 0
    assert s["generated"] == s["trained"] + s["dropped_stale"] + s["failed"] + s["in_flight"]
