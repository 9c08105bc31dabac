"""A small ``code`` task: complete a one-line Python function; scored by unit tests passed.

Each problem (``data/code_problems.jsonl``, written for this project) is a prompt such as
``"def sq(x): return "``, a reference answer and a few tests, each ``EXPR == LITERAL`` or
``EXPR is True|False|None``. The completion's first line is appended to the prompt and
the sandbox evaluates only the tests' left-hand sides (``sq(3)``), printing each value's
``repr``. The verdict is reached here, on the host: each reported value is parsed as a
literal and compared with the expected one, which never enters the sandbox. Whatever the
solution does in its process (inspect frames, patch ``eval`` or ``print``, exit early,
print fake lines) it can only change the values reported, and a value only counts when
it is the right one: the solution cannot produce or alter its own verdict.
"""

from __future__ import annotations

import ast
import json
import secrets
from pathlib import Path
from typing import Any

from loomrl.sandbox import SandboxPool, default_pool

DATA_PATH = Path(__file__).with_name("data") / "code_problems.jsonl"
MAX_VALUE_CHARS = 4096  # a reported value longer than this cannot match

_HARNESS = """
for _i, _subject in enumerate({subjects!r}):
    try:
        _value = repr(eval(_subject))
    except BaseException:
        _value = "<error>"
    print({nonce!r}, _i, _value[:{max_chars}].replace("\\n", " "))
"""


def load_problems(path: str | Path = DATA_PATH) -> list[dict[str, Any]]:
    """The shipped problems (or another file of the same shape)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def split_test(test: str) -> tuple[str, str, Any]:
    """``"sq(3) == 9"`` -> ``("sq(3)", "==", 9)``; ``"f(1) is True"`` -> ``("f(1)", "is", True)``."""
    try:
        tree = ast.parse(test, mode="eval").body
    except SyntaxError:
        tree = None
    if isinstance(tree, ast.Compare) and len(tree.ops) == 1:
        op = {ast.Eq: "==", ast.Is: "is"}.get(type(tree.ops[0]))
        try:
            expected = ast.literal_eval(tree.comparators[0])
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            op = None
        if op == "==" or (op == "is" and any(expected is v for v in (True, False, None))):
            return ast.unparse(tree.left), op, expected
    raise ValueError(
        f"a code task test must read 'EXPR == LITERAL' or 'EXPR is True|False|None', got {test!r}"
    )


def build_program(prompt: str, completion: str, subjects: list[str], nonce: str) -> str:
    """The solution followed by a harness that prints each subject's value, tagged."""
    harness = _HARNESS.format(subjects=subjects, nonce=nonce, max_chars=MAX_VALUE_CHARS)
    return prompt + completion.split("\n", 1)[0] + "\n" + harness


def matches(reported: str, op: str, expected: Any) -> bool:
    """Whether a reported ``repr`` is the expected value (judged here, never in the sandbox)."""
    try:
        value = ast.literal_eval(reported)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    if op == "is":
        return value is expected
    if isinstance(value, bool) != isinstance(expected, bool):
        return False  # True is not 1 here, whatever Python's == says
    try:
        return bool(value == expected)
    except (TypeError, ValueError, RecursionError):
        return False


def reported_values(stdout: str, nonce: str, count: int) -> dict[int, str]:
    """The last value the harness line reported for each test index."""
    found: dict[int, str] = {}
    for line in stdout.splitlines():
        tag, _, rest = line.partition(" ")
        index, _, value = rest.partition(" ")
        if tag == nonce and index.isdigit() and int(index) < count:
            found[int(index)] = value
    return found


async def score(
    prompt: str, completion: str, tests: list[str], pool: SandboxPool | None = None
) -> float:
    """Fraction of ``tests`` that pass with ``prompt + completion`` defined.

    The exec runs under the pool's own limits (``sandbox.timeout_s``).
    """
    if not tests:
        raise ValueError("a code problem needs at least one test")
    checks = [split_test(t) for t in tests]
    pool = pool or default_pool()
    nonce = secrets.token_hex(8)
    program = build_program(prompt, completion, [subject for subject, _, _ in checks], nonce)
    result = await pool.aexec(program, max_output_bytes=64 * 1024)
    values = reported_values(result.stdout, nonce, len(checks))
    passed = sum(
        1
        for i, (_, op, expected) in enumerate(checks)
        if i in values and matches(values[i], op, expected)
    )
    return passed / len(checks)


async def reward(prompt: str, completion: str, tests: list[str], **row: Any) -> float:
    """Reward function for ``task.reward``: fraction of the row's tests passed."""
    return await score(prompt, completion, tests)
