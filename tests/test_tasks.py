"""Built-in sandboxed tasks: countdown (single- and multi-turn) and the small code task."""

from __future__ import annotations

import asyncio
import re

import pytest

from loomrl.envs.episode import run_group_episodes
from loomrl.envs.tasks import code, countdown
from loomrl.sandbox import SandboxLimits, SandboxPool, set_default_pool
from loomrl.types import GenerationResult, SamplingParams

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
    [
        ("3+7-2", None),
        ("7-3", None),
        ("3+3", "uses a number"),
        ("__import__('os')", "characters"),
        ("3+", "not a Python"),
        ("", "empty"),
        ("9-1", "uses a number"),
    ],
)
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
        return [
            GenerationResult([[ord(c) for c in text]], [[-0.5] * len(text)], ["stop"], None, 0)
            for _ in requests
        ]

    rollouts = asyncio.run(
        run_group_episodes(
            [countdown.CountdownEnv(pool)],
            {"prompt": "3 7 2>8="},
            0,
            generate=generate,
            encode=lambda s: [ord(c) for c in s],
            decode=lambda ids: "".join(map(chr, ids)),
            sampling=SamplingParams(),
            max_turns=4,
            seed=0,
        )
    )
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


FORGERIES = {  # frames, patch eval and patch print forged 1.0 or 2/3 from the old in-process harness
    "frames": "(__import__('sys')._getframe(1).f_globals.__setitem__('_passed', 99), -1)[1]",
    "patch eval": "(__import__('builtins').__setattr__('eval', lambda *a, **k: True), -1)[1]",
    "patch print": (
        "(__import__('builtins').__setattr__('print', (lambda p: lambda *a, **k: p(a[0], 3))"
        "(print)), -1)[1]"
    ),
    "patch repr": "(__import__('builtins').__setattr__('repr', lambda v: '9'), -1)[1]",
    "early exit": "(__import__('os')._exit(0), -1)[1]",
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_code_task_verdict_cannot_be_forged_by_the_solution(pool, name):
    sq = code.load_problems()[0]  # sq(3) == 9, sq(-2) == 4, sq(0) == 0
    score = asyncio.run(code.reward(sq["prompt"], FORGERIES[name], sq["tests"]))
    assert score <= 1 / 3, f"{name}: the solution forged its own score {score}"


def test_code_task_expected_values_never_enter_the_sandbox(pool, monkeypatch):
    sent = []
    real = pool.aexec

    async def spy(code_text, **kwargs):
        sent.append(code_text)
        return await real(code_text, **kwargs)

    monkeypatch.setattr(pool, "aexec", spy)
    add = code.load_problems()[1]  # add(1, 2) == 3, add(-1, 1) == 0, add(10, 5) == 15
    assert asyncio.run(code.reward(add["prompt"], "a+b", add["tests"])) == 1.0
    (program,) = sent
    program = re.sub(r"'[0-9a-f]{16}'", "'NONCE'", program)  # a random nonce may hold "15"
    assert "add(10, 5)" in program and "15" not in program and "==" not in program


def test_code_task_tests_must_be_literal_comparisons():
    assert code.split_test("sq(3) == 9") == ("sq(3)", "==", 9)
    assert code.split_test("even(2) is True") == ("even(2)", "is", True)
    for bad in ("sq(3) > 2", "sq(3) == x", "even(2) is 1", "sq(3)", "1 == 1 == 1", "sq("):
        with pytest.raises(ValueError, match="EXPR == LITERAL"):
            code.split_test(bad)
    assert not code.matches("True", "==", 1) and code.matches("9.0", "==", 9)
    assert not code.matches("__import__('os')", "==", 0) and not code.matches("1", "is", True)


@pytest.fixture
def quick_pool():
    p = SandboxPool(limits=SandboxLimits(timeout_s=0.5), min_warm=1, max_warm=1, max_sandboxes=2)
    yield p
    p.close()


def test_tasks_use_the_sandbox_timeout(quick_pool):
    """Both tasks run under sandbox.timeout_s, not a timeout of their own (issue 7)."""
    import time

    async def run():
        t0 = time.monotonic()
        value = await countdown.evaluate("9**9**9**9", quick_pool)
        t1 = time.monotonic()
        sleeper = "x if __import__('time').sleep(30) is None else x"
        score = await code.score("def sq(x): return ", sleeper, ["sq(3) == 9"], quick_pool)
        return value, t1 - t0, score, time.monotonic() - t1

    value, countdown_s, score, code_s = asyncio.run(run())
    assert value is None and score == 0.0
    assert countdown_s < 1.9 and code_s < 2.9, (countdown_s, code_s)  # their old fixed limits
    assert quick_pool.metrics()["sandbox/kills_timeout"] == 2
