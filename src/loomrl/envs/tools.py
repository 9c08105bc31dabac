"""Tool calls run under limits: every failure becomes a tool message the model reads.

``ToolRunner.run(message)`` answers an assistant message with one tool message per call (in
order; calls of one message run concurrently) and one per malformed call. What can go
wrong, each counted by kind in the runner's ``ToolLog``:

- ``malformed``: the parser could not read the call;
- ``unknown_tool``: no tool of that name;
- ``bad_arguments``: the arguments do not bind to the function, or a value has the wrong
  JSON type for the schema;
- ``raised``: the tool raised (its type and message are shown);
- ``timeout``: the tool ran past ``timeout_s``. An ``async`` tool is cancelled; a plain
  function runs on a daemon worker thread, which Python cannot stop: the episode goes
  on without it and the thread ends when the function returns (a tool that may hang for
  good belongs in the episode's sandbox, whose processes are killed).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import queue
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loomrl.envs.messages import AssistantMessage, ToolCall

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout")

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "string": (str,),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass
class ToolLog:
    """What one episode's tool calls did: calls by tool (the well-formed ones that named a
    known tool), errors by kind, and tool results cut to the token limit."""

    calls: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    cuts: int = 0

    @property
    def num_attempts(self) -> int:
        """Every call the model tried to make, well-formed or not."""
        return sum(self.calls.values()) + self.errors["malformed"] + self.errors["unknown_tool"]

    @property
    def num_valid(self) -> int:
        """Calls that ran and returned (no error of any kind)."""
        return sum(self.calls.values()) - sum(
            self.errors[k] for k in ("bad_arguments", "raised", "timeout")
        )


class ToolError(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def tool_message(call_id: str, name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


class ToolRunner:
    """Runs one episode's tool calls (module docstring). ``cut(text) -> (text, was_cut)``
    bounds a result's length (``task.chat.max_tool_result_tokens``)."""

    def __init__(
        self,
        tools: list[Callable[..., Any]],
        timeout_s: float = 10.0,
        cut: Callable[[str], tuple[str, bool]] | None = None,
    ) -> None:
        self.schemas = schemas = tool_schemas(tools)
        self.tools = {s["function"]["name"]: fn for s, fn in zip(schemas, tools)}
        self.params = {s["function"]["name"]: s["function"]["parameters"] for s in schemas}
        self.timeout_s, self.cut, self.log = timeout_s, cut, ToolLog()

    async def run(self, message: AssistantMessage) -> list[dict[str, Any]]:
        """The tool messages answering ``message``: its malformed calls', then its calls'."""
        answers = []
        for error in message.parse_errors:
            self.log.errors["malformed"] += 1
            answers.append(
                tool_message("malformed", "error", f"error: malformed tool call: {error}")
            )
        results = await asyncio.gather(*(self._answer(call) for call in message.tool_calls))
        return answers + list(results)

    async def _answer(self, call: ToolCall) -> dict[str, Any]:
        try:
            text = await self._call(call)
        except ToolError as err:
            self.log.errors[err.kind] += 1
            return tool_message(call.id, call.name, f"error: {err.kind}: {err}")
        if self.cut is not None:
            text, was_cut = self.cut(text)
            self.log.cuts += was_cut
        return tool_message(call.id, call.name, text)

    async def _call(self, call: ToolCall) -> str:
        fn = self.tools.get(call.name)
        if fn is None:
            raise ToolError(
                "unknown_tool", f"no tool {call.name!r}; tools: {', '.join(self.tools)}"
            )
        self.log.calls[call.name] += 1
        self._check_arguments(call, fn)
        try:
            if inspect.iscoroutinefunction(fn):
                value = await asyncio.wait_for(fn(**call.arguments), self.timeout_s)
            else:
                value = await asyncio.wait_for(_in_thread(fn, call.arguments), self.timeout_s)
        except TimeoutError:
            raise ToolError("timeout", f"{call.name} ran past {self.timeout_s:g} s") from None
        except Exception as err:  # noqa: BLE001 - a tool's own error, shown to the model
            raise ToolError("raised", f"{call.name} raised {type(err).__name__}: {err}") from None
        return value if isinstance(value, str) else json.dumps(value, default=str)

    def _check_arguments(self, call: ToolCall, fn: Callable[..., Any]) -> None:
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as err:
            raise ToolError("bad_arguments", f"{call.name}: {err}") from None
        properties = self.params[call.name].get("properties", {})
        for key, value in call.arguments.items():
            wanted = properties.get(key, {}).get("type")
            names = [wanted] if isinstance(wanted, str) else list(wanted or [])
            types = tuple(t for n in names for t in _JSON_TYPES.get(n, (object,)))
            bad_bool = isinstance(value, bool) and "boolean" not in names
            if names and (not isinstance(value, types) or bad_bool):
                raise ToolError(
                    "bad_arguments",
                    f"{call.name}: {key}={value!r} is not of type {' or '.join(names)}",
                )


class _DaemonWorkers:
    """Daemon threads that run plain-function tools, reused when idle: a new one starts only
    while every one is busy, so a hung call holds its own thread, never another call's, and
    never the interpreter's exit (starting a thread per call cost more than the episode's
    rendering: ``bench/chat_episodes.py``)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.idle, self.lock = 0, threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self.lock:
            start = self.idle == 0
            self.idle -= 0 if start else 1
        self.jobs.put(job)
        if start:
            threading.Thread(target=self._work, name="loomrl-tool", daemon=True).start()

    def _work(self) -> None:
        while True:
            self.jobs.get()()
            with self.lock:
                self.idle += 1


_WORKERS = _DaemonWorkers()


def _in_thread(fn: Callable[..., Any], arguments: dict[str, Any]) -> asyncio.Future:
    """``fn(**arguments)`` on a daemon worker thread, as a future of this loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(setter, value) -> None:
        if not future.done():
            setter(value)

    def hand_back(setter, value) -> None:
        try:
            loop.call_soon_threadsafe(settle, setter, value)
        except RuntimeError:  # the loop has closed: nobody waits for it any more
            pass

    def job() -> None:
        try:
            value = fn(**arguments)
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting coroutine
            hand_back(future.set_exception, err)
        else:
            hand_back(future.set_result, value)

    _WORKERS.submit(job)
    return future


def tool_schemas(tools: list[Callable[..., Any]]) -> list[dict[str, Any]]:
    """Each tool's JSON schema, as chat templates take it in ``tools=``; a function without
    type hints or a docstring fails here with transformers' own message, naming it."""
    schemas = []
    for tool in tools:
        try:
            schemas.append(_schema_of(tool))
        except Exception as err:  # noqa: BLE001 - transformers raises several kinds; re-raised named
            name = getattr(tool, "__name__", repr(tool))
            raise TypeError(
                f"tool {name!r} has no usable schema ({type(err).__name__}: {err}); give it type "
                "hints and a docstring with an Args: section"
            ) from err
    return schemas


@functools.lru_cache(maxsize=1024)
def _schema_of(tool: Callable[..., Any]) -> dict[str, Any]:
    """A tool's schema, made once per function (every episode offers the same tools)."""
    from transformers.utils import get_json_schema

    return get_json_schema(tool)
