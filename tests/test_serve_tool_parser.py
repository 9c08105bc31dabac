"""The endpoint's ``serve.tool_parser`` names the same parsers chat episodes use."""

from __future__ import annotations

import json

import pytest

from loomrl.serve.policy import _tool_call, load_tool_parser


def test_a_built_in_parser_name_gives_openai_tool_calls():
    parse = load_tool_parser("hermes")
    text = 'Let me check.<tool_call>{"name": "mul", "arguments": {"a": 123, "b": 456}}</tool_call>'
    content, calls, errors = parse(text)
    assert content == "Let me check." and errors == []
    call = _tool_call(calls[0], 0)
    assert call["type"] == "function" and call["function"]["name"] == "mul"
    assert json.loads(call["function"]["arguments"]) == {"a": 123, "b": 456}


def test_a_malformed_call_is_an_error_not_a_call():
    _, calls, errors = load_tool_parser("hermes")("<tool_call>{not json</tool_call>")
    assert calls == [] and len(errors) == 1


def test_an_unknown_parser_name_is_refused_by_name():
    with pytest.raises(ValueError, match="serve.tool_parser='nope'"):
        load_tool_parser("nope")
