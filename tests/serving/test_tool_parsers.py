"""Tool-call parsers (hermes, llama3-json), tools validation and the forced-call schemas."""
from __future__ import annotations

import json

import pytest

from fxcompiler.serving.tool_parsers import calls_from_forced, check_tools, forced_schema, parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "now"}}]


def test_hermes():
    text = ('Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>')
    content, calls = parse_tool_calls("hermes", text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}), ("now", {})]
    assert calls[0].to_openai()["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert parse_tool_calls("hermes", "no calls here") == ("no calls here", [])
    broken = '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'
    assert parse_tool_calls("hermes", broken) == (broken, [])  # unparsable: left as content


def test_llama3_json():
    content, calls = parse_tool_calls("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}'
                                                     '; {"name": "now", "parameters": {}}')
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 3, "b": 4}),
                                                                                    ("now", {})]
    assert parse_tool_calls("llama3_json", "The answer is 7.") == ("The answer is 7.", [])
    assert parse_tool_calls("llama3_json", '{"name": "add", "parameters": {"a": ') [1] == []
    assert parse_tool_calls("llama3_json", '{"no_name": 1}')[1] == []
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        parse_tool_calls("mistral", "x")


def test_check_tools_and_forced_schemas():
    functions = check_tools(TOOLS, "auto")
    assert list(functions) == ["add", "now"] and functions["now"] == {"type": "object", "properties": {}}
    for tools, choice, match in ((None, "required", "needs tools"), ([], None, "non-empty"),
                                 ([{"type": "function"}], None, r"tools\[0\]"),
                                 ([{"type": "function", "function": {"name": "a b"}}], None, "name"),
                                 (TOOLS + TOOLS[:1], None, "duplicate"),
                                 (TOOLS, {"type": "function", "function": {"name": "sub"}}, "name one of"),
                                 (TOOLS, "always", "tool_choice")):
        with pytest.raises(ValueError, match=match):
            check_tools(tools, choice)
    named = {"type": "function", "function": {"name": "add"}}
    assert forced_schema(functions, named) == functions["add"]
    assert forced_schema(functions, "auto") is None
    req = forced_schema(functions, "required")
    assert req["type"] == "array" and len(req["items"]["anyOf"]) == 2 and "maxItems" not in req
    assert forced_schema(functions, "required", parallel=False)["maxItems"] == 1
    assert [(c.name, c.arguments) for c in calls_from_forced('{"a": 1}', named)] == [("add", '{"a": 1}')]
    calls = calls_from_forced('[{"name": "now", "parameters": {}}, {"name": "add", "parameters": {"a": 2}}]',
                              "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("now", {}), ("add", {"a": 2})]
