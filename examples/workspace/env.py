"""A coding task in the episode's sandbox: write a module, run its tests, fix it, answer.

Each episode opens a ``Workspace`` from the job's sandbox pool in ``reset``: one private
directory that every tool call of this episode runs in, so the module the model writes
in one turn is the one its tests import two turns later. The task's tests are placed in
the workspace at the start (``test_solution.py``, which the model may run as often as it
likes); when the model answers without a tool call, ``reward`` grades the workspace's
``solution.py`` against a fresh copy of the same tests (whatever the model did to its
copy) and scores the fraction that pass. ``close`` wipes the workspace, however the
episode ended.

Rows (``train.jsonl``): ``task`` (what to write), ``tests`` (Python expressions over the
module's names that must be true).
"""

from __future__ import annotations

import secrets
from typing import Any

from loomrl.envs.chat import ChatEnvironment
from loomrl.sandbox import Workspace, default_pool, workspace_tools

SYSTEM = (
    "You work in a private workspace directory, kept for this whole conversation. Use the "
    "tools to write solution.py, run `python3 test_solution.py`, fix what fails, and answer "
    "(without a tool call) once every test passes."
)
# The tests as a script the model can run; ``{tag}`` marks the grader's own lines.
TEST_SCRIPT = """import solution

TESTS = {tests!r}
passed = 0
for expr in TESTS:
    try:
        ok = bool(eval(expr, vars(solution)))
    except Exception as err:
        ok = False
        print("error in", expr, "->", repr(err))
    passed += ok
    print("{tag}PASS" if ok else "{tag}FAIL", expr)
print(passed, "of", len(TESTS), "passed")
"""


def test_script(tests: list[str], tag: str = "") -> str:
    return TEST_SCRIPT.format(tests=list(tests), tag=tag)


class WorkspaceEnv(ChatEnvironment):
    """One coding episode in its own workspace; ``timeout_s`` bounds each tool call."""

    def __init__(self, timeout_s: float = 5.0, pool: Any = None) -> None:
        super().__init__()
        self.timeout_s = timeout_s
        self.pool = pool
        self.ws: Workspace | None = None
        # Bound to whichever workspace the current episode holds (opened in ``reset``).
        self.tools = workspace_tools(self._workspace)

    def _workspace(self) -> Workspace:
        if self.ws is None:
            raise RuntimeError("no workspace: the episode has not been reset")
        return self.ws

    def reset(self, row: dict[str, Any]) -> list[dict]:
        self.close()
        self.ws = (self.pool or default_pool()).workspace(timeout_s=self.timeout_s)
        self.ws.write_file("test_solution.py", test_script(row["tests"]))
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": row["task"]},
        ]

    def reward(self, messages: list[dict], row: dict[str, Any]) -> float:
        """The fraction of the row's tests that ``solution.py`` passes, graded with a copy
        of the tests the model never saw under a random tag (it cannot print a pass)."""
        tag = secrets.token_hex(8)
        result = self._workspace().run_python(test_script(row["tests"], tag + " "))
        passed = sum(line.startswith(tag + " PASS") for line in result.stdout.splitlines())
        return passed / len(row["tests"])

    def close(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None:
            ws.close()
