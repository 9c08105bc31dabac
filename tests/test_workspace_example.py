"""examples/workspace end to end without a model: a scripted policy writes a buggy module,
runs the tests, reads its own file back, fixes it and answers; the workspace keeps its
files across those turns, the reward grades it, and ``close`` wipes it."""

from __future__ import annotations

import pytest

from examples.workspace.env import WorkspaceEnv
from examples.workspace.scripted import BUGGY, ROWS, SCRIPT, drive
from loomrl.sandbox import SandboxLimits, SandboxPool

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def pool():
    p = SandboxPool(limits=SandboxLimits(timeout_s=5.0), min_warm=1, max_warm=2, max_sandboxes=2)
    yield p
    p.close()


def test_scripted_episode_keeps_its_files_across_turns_and_scores(pool):
    env = WorkspaceEnv(pool=pool)
    try:
        messages, reward = drive(env, ROWS[0], SCRIPT)
    finally:
        env.close()
    results = [m["content"] for m in messages if m["role"] == "tool"]
    # Turn 2 ran the tests against turn 1's file; turn 3 read it back unchanged.
    assert "3 of 4 passed" in results[1] and "FAIL is_palindrome('Never odd or even')" in results[1]
    assert results[2] == BUGGY
    assert "4 of 4 passed" in results[4]
    assert reward == 1.0
    assert env.ws is None and pool.metrics()["sandbox/workspaces_open"] == 0


def test_a_buggy_answer_scores_its_passing_fraction_and_episodes_do_not_share(pool):
    env = WorkspaceEnv(pool=pool)
    try:
        _, reward = drive(env, ROWS[0], [SCRIPT[0], "done"])
        assert reward == 0.75
        # The next episode (same env object, next row) starts from an empty workspace.
        _, reward = drive(env, ROWS[1], [("read_file", {"path": "solution.py"}), "done"])
    except FileNotFoundError:
        reward = None
    finally:
        env.close()
    assert reward is None, "the second episode found the first episode's solution.py"


def test_printed_passes_cannot_fool_the_grader(pool):
    forged = "print('PASS x\\n' * 10)\ndef is_palindrome(s):\n    return False\n"
    env = WorkspaceEnv(pool=pool)
    try:
        _, reward = drive(
            env, ROWS[0], [("write_file", {"path": "solution.py", "content": forged}), "done"]
        )
    finally:
        env.close()
    assert reward == 0.25  # only "not is_palindrome('abc')" holds


def test_tools_exist_before_reset_and_refuse_to_run_without_a_workspace(pool):
    env = WorkspaceEnv(pool=pool)
    assert [fn.__name__ for fn in env.tools] == ["python", "shell", "read_file", "write_file"]
    with pytest.raises(RuntimeError, match="not been reset"):
        env.tools[1]("ls")
    env.close()
