"""The workspace example without a model: a scripted policy plays the assistant's turns.

    python -m examples.workspace.scripted

It writes a buggy ``solution.py``, runs the tests (3 of 4 pass), reads its own file back,
fixes it, runs the tests again and answers; the tool results show the workspace keeping
its files from turn to turn, and the reward grades the final file. ``drive`` is how
``tests/test_workspace_example.py`` runs the same episodes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from examples.workspace.env import WorkspaceEnv

ROWS = [json.loads(line) for line in (Path(__file__).parent / "train.jsonl").open()]
BUGGY = "def is_palindrome(s):\n    return s == s[::-1]\n"
FIXED = "def is_palindrome(s):\n    s = s.replace(' ', '').lower()\n    return s == s[::-1]\n"
RUN_TESTS = (
    "import subprocess\n"
    "print(subprocess.run(['python3', 'test_solution.py'], capture_output=True, text=True).stdout)"
)
# Each assistant turn is a tool call (name, arguments) or, last, the answer.
SCRIPT: list[Any] = [
    ("write_file", {"path": "solution.py", "content": BUGGY}),
    ("shell", {"command": "python3 test_solution.py"}),
    ("read_file", {"path": "solution.py"}),
    ("write_file", {"path": "solution.py", "content": FIXED}),
    ("python", {"code": RUN_TESTS}),
    "All four tests pass.",
]


def drive(env: WorkspaceEnv, row: dict, script: list) -> tuple[list[dict], float]:
    """One episode: each tool call runs against ``env.tools`` and its result comes back as
    a tool message; the answer ends it with ``env.reward``. The caller closes ``env``."""
    tools = {fn.__name__: fn for fn in env.tools}
    messages = env.reset(row)
    for turn in script:
        if isinstance(turn, str):
            messages.append({"role": "assistant", "content": turn})
            return messages, env.reward(messages, row)
        name, args = turn
        call = {"type": "function", "function": {"name": name, "arguments": args}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "name": name, "content": tools[name](**args)})
    raise ValueError("the script never answered")


def main() -> None:
    env = WorkspaceEnv()
    try:
        messages, reward = drive(env, ROWS[0], SCRIPT)
    finally:
        env.close()
    for message in messages:
        calls = message.get("tool_calls")
        body = json.dumps(calls[0]["function"]) if calls else message["content"]
        print(f"--- {message['role']}\n{body}")
    print(f"--- reward {reward}")


if __name__ == "__main__":
    main()
