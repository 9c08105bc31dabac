"""A small ``code`` task: complete a one-line Python function; scored by unit tests passed.

Each problem (``data/code_problems.jsonl``, written for this project) is a prompt such as
``"def sq(x): return "``, a reference answer and a few test expressions. The completion
is appended to the prompt, the tests run in the sandbox, and the reward is the fraction
that pass. The harness reports through a line tagged with a per-call random nonce, so
printing a fake score does not work; the tests run in the same process as the
solution, so a model that inspects its caller's frames could still forge one (a known
limit of this small task; an adversarial setting would run each test in its own exec).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from loomrl.sandbox import SandboxPool, default_pool

DATA_PATH = Path(__file__).with_name("data") / "code_problems.jsonl"

_HARNESS = """
import json as _json
_passed = 0
for _test in {tests!r}:
    try:
        if eval(_test):
            _passed += 1
    except BaseException:
        pass
print({nonce!r}, _json.dumps(_passed))
"""


def load_problems(path: str | Path = DATA_PATH) -> list[dict[str, Any]]:
    """The shipped problems (or another file of the same shape)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def build_program(prompt: str, completion: str, tests: list[str], nonce: str) -> str:
    return prompt + completion.split("\n", 1)[0] + "\n" + _HARNESS.format(tests=tests, nonce=nonce)


async def score(
    prompt: str, completion: str, tests: list[str], pool: SandboxPool | None = None
) -> float:
    """Fraction of ``tests`` that pass with ``prompt + completion`` defined."""
    if not tests:
        raise ValueError("a code problem needs at least one test")
    pool = pool or default_pool()
    nonce = secrets.token_hex(8)
    program = build_program(prompt, completion, tests, nonce)
    result = await pool.aexec(program, timeout_s=3.0, max_output_bytes=64 * 1024)
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(nonce + " "):
            passed = int(line.split()[1])
            return max(0, min(passed, len(tests))) / len(tests)
    return 0.0


async def reward(prompt: str, completion: str, tests: list[str], **row: Any) -> float:
    """Reward function for ``task.reward``: fraction of the row's tests passed."""
    return await score(prompt, completion, tests)
