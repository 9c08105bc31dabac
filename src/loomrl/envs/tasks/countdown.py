"""Countdown-style task: reach a target with a Python expression over the given numbers.

A prompt looks like ``"3 7 2>8="``: numbers, then the target. The completion is a Python
expression such as ``3+7-2``. The host checks the expression's shape (digits, ``+ - * ( )``
and spaces only; each given number used at most once) and the sandbox evaluates it.
Reward: 1.0 when it evaluates to the target, ``FORMAT_REWARD`` for a well-formed
expression over the given numbers that misses, 0.0 otherwise.

``reward`` is the single-turn reward function (async; it uses the process-wide default
pool); ``CountdownEnv`` is the multi-turn version that answers a miss with the value the
expression reached (``"=9 no\\n"``) and lets the model try again.
"""

from __future__ import annotations

import ast
import logging
import random
from collections import Counter
from typing import Any

from loomrl.envs.base import Environment, StepResult
from loomrl.sandbox import SandboxPool, default_pool

logger = logging.getLogger(__name__)

FORMAT_REWARD = 0.1
ALLOWED_CHARS = set("0123456789+-*() ")
MAX_EXPRESSION_CHARS = 32


def parse_prompt(prompt: str) -> tuple[list[int], int]:
    """``"3 7 2>8="`` -> ``([3, 7, 2], 8)``."""
    numbers_text, _, rest = prompt.partition(">")
    return [int(x) for x in numbers_text.split()], int(rest.rstrip("=").strip())


def check_expression(expression: str, numbers: list[int]) -> str | None:
    """Why ``expression`` is not an admissible answer, or None if it is."""
    expression = expression.strip()
    if not expression or len(expression) > MAX_EXPRESSION_CHARS:
        return "empty or too long"
    if not set(expression) <= ALLOWED_CHARS:
        return "characters other than digits, + - * ( ) and spaces"
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        return "not a Python expression"
    used = Counter(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant))
    available = Counter(numbers)
    if any(count > available[value] for value, count in used.items()):
        return "uses a number that was not given, or one more than once"
    return None


async def evaluate(expression: str, pool: SandboxPool | None = None) -> int | None:
    """The expression's value as computed in the sandbox, or None if it did not evaluate.

    The exec runs under the pool's own limits (``sandbox.timeout_s``).
    """
    pool = pool or default_pool()
    code = f"print(int({expression.strip()}))"
    result = await pool.aexec(code, max_output_bytes=256)
    if not result.ok:
        return None
    try:
        return int(result.stdout.strip())
    except ValueError:
        return None


async def reward(prompt: str, completion: str, **row: Any) -> float:
    """Single-turn reward: 1.0 on target, FORMAT_REWARD for a valid miss, else 0.0."""
    numbers, target = parse_prompt(prompt)
    if check_expression(completion, numbers) is not None:
        return 0.0
    value = await evaluate(completion)
    if value is None:
        return 0.0
    return 1.0 if value == target else FORMAT_REWARD


class CountdownEnv(Environment):
    """Multi-turn countdown: a miss is answered with the value reached; solve it to finish."""

    def __init__(self, pool: SandboxPool | None = None) -> None:
        self._pool = pool
        self.numbers: list[int] = []
        self.target = 0

    def reset(self, row: dict[str, Any]) -> str:
        self.numbers, self.target = parse_prompt(row["prompt"])
        return row["prompt"]

    async def step(self, completion: str) -> StepResult:
        problem = check_expression(completion, self.numbers)
        if problem is not None:
            return StepResult(observation=" bad\n", reward=0.0, done=False)
        value = await evaluate(completion, self._pool)
        if value == self.target:
            return StepResult(observation="", reward=1.0, done=True)
        return StepResult(observation=f" ={value} no\n", reward=0.0, done=False)


def _draw(rng: random.Random, count: int, max_number: int) -> tuple[str, str]:
    numbers = [rng.randint(1, max_number) for _ in range(count)]
    picked = rng.sample(numbers, count)
    ops = [rng.choice("+-") for _ in picked[1:]]
    answer = str(picked[0]) + "".join(op + str(n) for op, n in zip(ops, picked[1:]))
    target = eval(answer)  # our own digits and +/-
    return f"{' '.join(map(str, numbers))}>{target}=", answer if target >= 1 else ""


def make_rows(num_rows: int, seed: int, three_fraction: float = 0.3) -> list[dict[str, Any]]:
    """Distinct problems, shuffled: two numbers in 1..19, or (``three_fraction`` of the
    rows) three in 1..9; the target is reached with + and - using every number, >= 1."""
    rng = random.Random(seed)
    num_three = round(num_rows * three_fraction)
    rows, seen = [], set()
    for count, wanted, max_number in ((3, num_three, 9), (2, num_rows - num_three, 19)):
        made = 0
        for _ in range(wanted * 100):
            if made == wanted:
                break
            prompt, answer = _draw(rng, count, max_number)
            if answer and prompt not in seen:
                seen.add(prompt)
                rows.append({"prompt": prompt, "answer": answer})
                made += 1
    rng.shuffle(rows)
    return rows
