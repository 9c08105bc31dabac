"""Tool calls read from the model's text, by the format its chat template taught it.

A parser takes an assistant turn's text and returns ``(content, tool_calls, errors)``: the
text outside the calls, the calls it could read and one message per call it could not
(each becomes a tool message the model reads: a malformed call never crashes an episode).
Parsers are chosen by name (``task.chat.tool_parser``):

- ``hermes``: Hermes and Qwen2.5/Qwen3, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- ``llama3_json``: Llama 3.1/3.2, the turn is one JSON object (or several split by ``;``)
  ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from loomrl.envs.messages import ToolCall

ParseResult = tuple[str, list[ToolCall], list[str]]
Parser = Callable[[str], ParseResult]

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def _call_of(obj: Any, index: int, args_key: str = "arguments") -> ToolCall | str:
    """A ToolCall from a decoded JSON object, or why it is not one."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return "a tool call needs a 'name' string"
    arguments = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return f"the arguments of {name!r} are not a JSON object"
    if not isinstance(arguments, dict):
        return f"the arguments of {name!r} must be a JSON object"
    call_id = obj.get("id")
    return ToolCall(
        id=call_id if isinstance(call_id, str) else f"call_{index}", name=name, arguments=arguments
    )


def _decode(text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except ValueError as err:
        return None, f"malformed tool call JSON ({err.msg} at char {err.pos}): {text[:80]!r}"


def parse_hermes(text: str) -> ParseResult:
    """``<tool_call>{json}</tool_call>`` blocks; the content is the text outside them. A
    block left open at the end of the turn is malformed (the turn was cut inside it)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for match in _HERMES.finditer(text):
        if not match.group(2):
            errors.append(f"unclosed <tool_call>: {match.group(1)[:80]!r}")
            continue
        obj, error = _decode(match.group(1).strip())
        made = error if error is not None else _call_of(obj, len(calls) + len(errors))
        (errors if isinstance(made, str) else calls).append(made)  # type: ignore[arg-type]
    content = _HERMES.sub("", text).strip()
    return content, calls, errors


def parse_llama3_json(text: str) -> ParseResult:
    """A turn that is a JSON object with ``name`` (Llama 3's built-in format) is a call;
    any other turn is content."""
    body = text.replace("<|python_tag|>", "").strip()
    if not body.startswith("{"):
        return text.strip(), [], []
    calls: list[ToolCall] = []
    errors: list[str] = []
    for part in (p.strip() for p in body.split(";")):
        if not part:
            continue
        obj, error = _decode(part)
        made = error if error is not None else _call_of(obj, len(calls) + len(errors), "parameters")
        (errors if isinstance(made, str) else calls).append(made)  # type: ignore[arg-type]
    return "", calls, errors


def parse_mistral(text: str) -> ParseResult:
    """``[TOOL_CALLS]`` followed by a JSON list of calls; the content is the text before."""
    content, marker, rest = text.partition("[TOOL_CALLS]")
    if not marker:
        return text.strip(), [], []
    obj, error = _decode(rest.strip())
    if error is not None:
        return content.strip(), [], [error]
    objs = obj if isinstance(obj, list) else [obj]
    calls: list[ToolCall] = []
    errors: list[str] = []
    for i, item in enumerate(objs):
        made = _call_of(item, i)
        (errors if isinstance(made, str) else calls).append(made)  # type: ignore[arg-type]
    return content.strip(), calls, errors


PARSERS: dict[str, Parser] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "mistral": parse_mistral,
}


def get_parser(name: str) -> Parser:
    """The parser registered as ``name``; an unknown name fails naming the known ones."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; expected one of {sorted(PARSERS)}"
        ) from None


def register_parser(name: str, parser: Parser) -> None:
    """Add a parser for another format (``parser(text) -> (content, tool_calls, errors)``)."""
    PARSERS[name] = parser
