"""Tool-call parsers: each format's calls, its content, and what it cannot read."""

from __future__ import annotations

import pytest

from loomrl.envs.tool_parsers import get_parser, register_parser


def test_hermes_reads_every_block_and_keeps_the_text_outside():
    text = 'Let me.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>'
    content, calls, errors = get_parser("hermes")(text)
    assert content == "Let me." and errors == []
    assert [(c.name, c.arguments, c.id) for c in calls] == [
        ("f", {"x": 1}, "call_0"),
        ("g", {"y": 2}, "call_1"),
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<tool_call>{nope}</tool_call>", "malformed tool call JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "needs a 'name'"),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "f"', "unclosed <tool_call>"),
        ("<tool_call>[1, 2]</tool_call>", "must be a JSON object, got list"),
    ],
)
def test_hermes_reports_what_it_cannot_read(text, error):
    _, calls, errors = get_parser("hermes")(text)
    assert calls == [] and len(errors) == 1 and error in errors[0]


def test_llama3_json_reads_a_turn_that_is_a_call_and_leaves_text_alone():
    parse = get_parser("llama3_json")
    content, calls, errors = parse(
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'
    )
    assert (
        content == ""
        and errors == []
        and [(c.name, c.arguments) for c in calls] == [("f", {"x": 1}), ("g", {})]
    )
    assert parse("The answer is 4.") == ("The answer is 4.", [], [])
    assert "malformed" in parse('{"name": "f", "parameters": {')[2][0]


def test_mistral_reads_the_list_after_its_marker():
    parse = get_parser("mistral")
    content, calls, errors = parse(
        'ok [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}, "id": "abc123xyz"}]'
    )
    assert content == "ok" and errors == [] and (calls[0].name, calls[0].id) == ("f", "abc123xyz")
    assert parse("plain") == ("plain", [], [])
    assert parse("[TOOL_CALLS][{]")[2] and parse("[TOOL_CALLS][{]")[1] == []


def test_an_unknown_parser_is_named_and_a_new_one_can_be_registered():
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'.*hermes"):
        get_parser("nope")
    register_parser("shout", lambda text: (text.upper(), [], []))
    assert get_parser("shout")("hi") == ("HI", [], [])
