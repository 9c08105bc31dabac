"""Built-in sandboxed tasks: countdown (single- and multi-turn) and the small code task."""

from __future__ import annotations

import asyncio

import pytest

from loomrl.envs.episode import run_group_episodes
from loomrl.envs.tasks import code, countdown
from loomrl.sandbox import SandboxLimits, SandboxPool, set_default_pool
from loomrl.types import Completion, GenerationResult, SamplingParams

from sandbox_helpers import BACKENDS

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=BACKENDS)
def pool(request):
    p = SandboxPool(
        request.param, limits=SandboxLimits(timeout_s=3), min_warm=1, max_warm=2, max_sandboxes=4
    )
    set_default_pool(p)
    yield p
    set_default_pool(None)
    p.close()


@pytest.mark.parametrize(
    "expression, problem",
    [("3+7-2", None), ("7-3", None), ("3+3", "uses a number"), ("__import__('os')", "characters"),
     ("3+", "not a Python"), ("", "empty"), ("9-1", "uses a number")],
)  # fmt: skip
def test_countdown_expression_check(expression, problem):
    found = countdown.check_expression(expression, [3, 7, 2])
    assert (found is None) if problem is None else (problem in found)


def test_countdown_reward_in_the_sandbox(pool):
    async def score_all():
        cases = ["3+7-2", "7+3", "3+3", "os.system('x')", "7-2-3"]
        return await asyncio.gather(*(countdown.reward("3 7 2>8=", c) for c in cases))

    assert asyncio.run(score_all()) == [
        1.0,
        countdown.FORMAT_REWARD,
        0.0,
        0.0,
        countdown.FORMAT_REWARD,
    ]
    assert pool.metrics()["sandbox/execs"] >= 3


def test_countdown_rows_are_distinct_short_and_solvable():
    rows = countdown.make_rows(300, seed=3)
    assert len({r["prompt"] for r in rows}) == len(rows) == 300
    for row in rows:
        numbers, target = countdown.parse_prompt(row["prompt"])
        assert len(row["prompt"]) < 40 and len(row["answer"]) < 16 and 2 <= len(numbers) <= 3
        assert countdown.check_expression(row["answer"], numbers) is None
        assert eval(row["answer"]) == target


def test_countdown_env_multi_turn_with_feedback(pool):
    answers = iter(["3+7", "3+7-2"])  # miss, then hit

    async def generate(requests):
        text = next(answers)
        return [GenerationResult([Completion([ord(c) for c in text], [-0.5] * len(text), "stop")], 0)
                for _ in requests]  # fmt: skip

    rollouts = asyncio.run(
        run_group_episodes(
            [countdown.CountdownEnv(pool)], {"prompt": "3 7 2>8="}, 0, generate=generate,
            encode=lambda s: [ord(c) for c in s], decode=lambda ids: "".join(map(chr, ids)),
            sampling=SamplingParams(), max_turns=4, seed=0,
        )
    )  # fmt: skip
    (ep,) = rollouts
    assert ep.status == "ok" and ep.reward == 1.0 and ep.num_turns == 2
    assert ep.completion == "3+7 =10 no\n3+7-2"
    assert ep.loss_mask == [1] * 3 + [0] * len(" =10 no\n") + [1] * 5


def test_code_task_reference_answers_pass_and_wrong_ones_do_not(pool):
    problems = code.load_problems()
    assert len(problems) == 12 and all(len(p["prompt"]) < 40 for p in problems)

    async def run():
        good = await asyncio.gather(
            *(code.reward(p["prompt"], p["answer"], p["tests"]) for p in problems)
        )
        bad = await asyncio.gather(
            *(code.reward(p["prompt"], "None", p["tests"]) for p in problems)
        )
        return good, bad

    good, bad = asyncio.run(run())
    assert good == [1.0] * 12 and bad == [0.0] * 12


def test_code_task_partial_credit_and_no_spoofing(pool):
    sq = code.load_problems()[0]
    assert asyncio.run(
        code.reward(sq["prompt"], "x*x if x > 0 else 0", sq["tests"])
    ) == pytest.approx(2 / 3)
    spoof = "print('3') or 0\nprint('3')\nimport sys; sys.exit(0)"  # only line 1 counts
    assert asyncio.run(code.reward(sq["prompt"], spoof, sq["tests"])) == pytest.approx(1 / 3)
    assert asyncio.run(code.reward(sq["prompt"], "__import__('os')._exit(0)", sq["tests"])) == 0.0
