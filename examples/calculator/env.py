"""The calculator task: a 3-digit by 3-digit product, which a tiny model cannot work out in
its head but can with the ``mul`` tool. The model calls the tool, reads its answer and
answers; the reward is 1.0 for exactly the product as the final answer, else 0.0."""

from __future__ import annotations

from typing import Any

from loomrl.envs.chat import ChatEnvironment


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


class Calculator(ChatEnvironment):
    """One question (``row["prompt"]``, e.g. ``"123*456"``), the ``mul`` tool, and exact match
    of the model's last answer (a turn without a tool call) with ``row["answer"]``."""

    tools = [mul]

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": row["prompt"]}]

    def reward(self, messages: list[dict[str, Any]], row: dict[str, Any]) -> float:
        last = messages[-1]
        answered = last["role"] == "assistant" and not last.get("tool_calls")
        return float(answered and last["content"].strip() == str(row["answer"]))
