"""Streaming tool calls (``delta.tool_calls``): fed in any pieces, the deltas assemble into what the
non-streamed parsers return; the header (id, name) comes first, arguments as they are written."""
from __future__ import annotations

import json
import random

import pytest

from fxcompiler.serving.tool_parsers import parse_tool_calls
from fxcompiler.serving.tool_streaming import ToolCallStreamer, accumulate, stream_tool_deltas

CASES = [
    ("hermes", 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "paris", "days": 3}}</tool_call>'),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
               '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>'),
    ("hermes", 'x <tool_call>{"arguments": {"a": [1, "}"]}, "name": "add"}</tool_call> tail'),  # name after args
    ("hermes", "no calls here, < and <tool but no call "),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>'),  # unparsable: content
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 3, "b": 4}}; {"name": "now", "parameters": {}}'),
    ("llama3_json", ' {"name": "add", "parameters": {"a": "x;y"}};'),
    ("llama3_json", '{"name": "now"}'),  # no parameters: {}
    ("llama3_json", "hello {x}"),
    ("llama3_json", "<|python"),
    ("llama3_json", '{"nom": 1}'),  # not a call: content
]


def splits(text: str, rng: random.Random):
    yield [text]
    yield list(text)
    for _ in range(25):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("parser,text", CASES)
def test_deltas_assemble_into_the_parsed_message(parser, text):
    want_content, want_calls = parse_tool_calls(parser, text)
    broken = not want_calls and ("<tool_call>{" in text or text.startswith("{"))
    for pieces in splits(text, random.Random(text)):
        deltas, called = stream_tool_deltas(parser, pieces)
        content, calls = accumulate(deltas)
        if broken and len(pieces) > 1 and calls:
            # a call's header went out before its text turned out unparsable: never counted as a call
            assert not called
            continue
        assert called == bool(want_calls)
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            (c.name, json.loads(c.arguments)) for c in want_calls], pieces
        assert content == (want_content if want_calls else text), pieces
        for d in deltas:  # every call opens with its header: id, type, name and empty arguments
            for tc in d.get("tool_calls", ()):
                if "id" in tc:
                    assert tc["type"] == "function" and tc["function"]["arguments"] == "" and tc["function"]["name"]


def test_arguments_stream_as_they_are_written():
    st = ToolCallStreamer("hermes")
    assert st.feed("Sure. <tool") == [{"content": "Sure."}]  # '<tool' may start a call; the space is held
    assert st.feed('_call>{"name": "get_') == []
    (header,) = st.feed('weather", "arguments": ')[0]["tool_calls"]
    assert header["function"] == {"name": "get_weather", "arguments": ""} and header["index"] == 0
    assert st.feed('{"city": "pa') == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "pa'}}]}]
    assert st.feed('ris"}}</tool_call>') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}]
    assert st.finish() == ([], True)
    st = ToolCallStreamer("llama3_json")
    assert st.feed("  ") == [] and st.feed("<|py") == []  # may still be <|python_tag|>
    assert st.feed("thon_tag|>") == []
    assert st.feed('{"name": "now", "parameters": {') [0]["tool_calls"][0]["function"]["name"] == "now"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ToolCallStreamer("pythonic")
