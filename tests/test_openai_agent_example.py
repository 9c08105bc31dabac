"""The openai_agent example's tool loop, against a scripted client: the calculator is
called when the model asks for it, and the reward is the final answer's exact match."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from examples.openai_agent.agent import calculator, solve


def test_the_calculator_evaluates_arithmetic_and_refuses_anything_else():
    assert calculator("12+34") == "46"
    assert calculator("(2+3)*4-1") == "19"
    assert calculator("__import__('os')").startswith("error")
    assert calculator("2**100").startswith("error")


class ScriptedClient:
    """Replies in order; records the messages each request sent."""

    def __init__(self, replies):
        self.replies, self.sent = list(replies), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **kwargs):
        self.sent.append([dict(m) for m in kwargs["messages"]])
        return SimpleNamespace(choices=[SimpleNamespace(message=self.replies.pop(0))])


def message(content=None, calls=None):
    from openai.types.chat import ChatCompletionMessage

    return ChatCompletionMessage(role="assistant", content=content, tool_calls=calls)


def test_the_loop_runs_the_tool_then_scores_the_answer():
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": "12+34"})},
    }
    client = ScriptedClient([message(calls=[call]), message("046")])
    reward = asyncio.run(solve(client, {"prompt": "12+34=", "answer": "046"}))
    assert reward == 1.0
    assert client.sent[1][-1] == {"role": "tool", "tool_call_id": "c1", "content": "46"}
    wrong = ScriptedClient([message("047")])
    assert asyncio.run(solve(wrong, {"prompt": "12+34=", "answer": "046"})) == 0.0
