"""Chat environments: episodes spoken in messages, with tools.

A ``ChatEnvironment`` opens an episode with messages (``reset(row)``), offers plain Python
functions as tools (``tools``: type hints and a Google-style docstring make the schema, as
TRL's ``tools=[fn, ...]`` does, through ``transformers.utils.get_json_schema``), and takes
each assistant message (its text and the tool calls parsed from it) in ``step``. The
default ``step`` runs the message's tool calls and answers with their tool messages; a
message without tool calls ends the episode with ``reward(messages, row)``. Any of
``reset``, ``step``, ``reward`` may be ``async``; ``close`` is called when the episode
ends, however it ends.

    class Calculator(ChatEnvironment):
        def __init__(self):
            self.tools = [multiply]

        def reset(self, row):
            return [{"role": "user", "content": row["prompt"]}]

        def reward(self, messages, row):
            return float(messages[-1]["content"].strip() == row["answer"])

``loomrl.envs.chat_episode`` drives the episodes and keeps them token-exact.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from loomrl.envs.messages import AssistantMessage, ChatStepResult, ToolCall
from loomrl.envs.tools import ToolRunner, tool_schemas

__all__ = [
    "AssistantMessage",
    "ChatEnvironment",
    "ChatStepResult",
    "ToolCall",
    "ToolRunner",
    "tool_schemas",
]


class ChatEnvironment:
    """A multi-turn chat environment; one instance serves one episode (module docstring).

    The episode driver sets ``row`` and ``messages`` (the conversation so far, the message
    being stepped included) before ``reset``/``step``, and ``runner``, which runs tool calls
    under the job's limits (``task.chat``) and counts them."""

    tools: list[Callable[..., Any]] = []
    row: dict[str, Any]
    messages: list[dict[str, Any]]
    runner: ToolRunner | None = None  # set by the driver

    def begin(self, row: dict[str, Any], runner: ToolRunner) -> None:
        """Called by the driver before ``reset``: the row, an empty conversation, the runner."""
        self.row, self.messages, self.runner = row, [], runner

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The opening messages (OpenAI-style dicts with ``role`` and ``content``)."""
        raise NotImplementedError(f"{type(self).__name__} must define reset(row) -> messages")

    async def step(self, message: AssistantMessage) -> ChatStepResult:
        """Run the message's tool calls and answer with their tool messages; a message with
        no tool call (and nothing malformed) ends the episode with ``reward``."""
        if not message.tool_calls and not message.parse_errors:
            reward = await _maybe_await(self.reward(self.messages, self.row))
            return ChatStepResult(messages=[], reward=reward, done=True)
        runner = self.runner
        if runner is None:  # (used outside a job's episodes: default limits)
            runner = self.runner = ToolRunner(self.tools)
        return ChatStepResult(messages=await runner.run(message), reward=0.0, done=False)

    def reward(self, messages: list[dict[str, Any]], row: dict[str, Any]) -> float:
        """The episode's reward once the model answers without a tool call (and when a limit
        cuts the episode short). Override it; this default gives 0.0."""
        return 0.0

    def close(self) -> None:
        """Release what the episode held (a workspace, a connection); always called."""


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
