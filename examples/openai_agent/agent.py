"""An ordinary ``openai``-client agent: a chat-completions loop with a calculator tool.

Nothing in it knows loomrl: it takes an ``openai.AsyncOpenAI`` client and a dataset row,
talks to the model until it answers without calling a tool, and returns its reward. loomrl
runs it ``group_size`` times per prompt against the policy being trained (``task.agent``),
and trains on exactly the tokens the model sampled.

The calculator is offered to the model as an OpenAI tool. With an instruct model and a
tool-call parser (``serve.tool_parser = "hermes"``) the model may call it; the tiny
character-level model of this example has no tool-call format and answers directly, which
is the skill it learns here (see docs/serve.md).
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

MODEL = "calculator-agent"  # serve.model_name in job.toml
MAX_TURNS = 3
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of integers with + - * and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12+34"}},
            "required": ["expression"],
        },
    },
}
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """The tool: integer + - * only, evaluated on the parsed tree (never ``eval``)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not an arithmetic expression: {expression!r}")

    try:
        return str(value(ast.parse(expression[:200], mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as err:
        return f"error: {err}"


async def solve(client: Any, row: dict[str, Any]) -> float:
    """Ask until the model answers without a tool call; 1.0 for the right answer."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=[CALCULATOR], max_tokens=4
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments or "{}")
            result = calculator(str(arguments.get("expression", "")))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = (messages[-1].get("content") or "").strip()
    return 1.0 if answer == row["answer"] else 0.0
