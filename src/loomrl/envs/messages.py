"""The messages of a chat episode as data: a tool call, the assistant's turn, a step's answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    """One call the model asked for: its id (made up when the format has none), the tool's
    name and its arguments (a JSON object)."""

    id: str
    name: str
    arguments: dict[str, Any]

    def as_message_part(self) -> dict[str, Any]:
        """The OpenAI-style ``tool_calls`` entry chat templates render."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class AssistantMessage:
    """The model's turn: its text outside tool calls, the calls parsed from it, and what the
    parser could not read (each a malformed call the model is told about)."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)

    def as_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.as_message_part() for call in self.tool_calls]
        return message


@dataclass
class ChatStepResult:
    """What a step answers: the next messages (tool results, a user turn), a reward for this
    step (an episode's reward is the sum over its steps) and whether the episode is over."""

    messages: list[dict[str, Any]]
    reward: float
    done: bool
