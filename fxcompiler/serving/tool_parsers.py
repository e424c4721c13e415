"""Tool calls: parsing model output into OpenAI ``tool_calls`` (hermes, llama3-json), and the JSON
schemas that force a call when ``tool_choice`` is ``required`` or names a function (guided decoding).

hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen, Hermes, SmolLM).
llama3-json: the whole output is ``{"name": ..., "parameters": {...}}`` (optionally after
``<|python_tag|>``), several calls separated by ``;``.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = ["ToolCall", "parse_tool_calls", "PARSERS", "check_tools", "forced_schema", "calls_from_forced"]


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text

    def to_openai(self) -> dict[str, Any]:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj: Any, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """(content outside the tool-call blocks, the calls); unparsable blocks stay in the content."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _HERMES.finditer(text):
        try:
            call = _call(json.loads(m.group(1)), "arguments")
        except ValueError:
            call = None
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    return ("".join(kept).strip() if calls else text), calls


def parse_llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    """The whole output as ``;``-separated JSON calls, or no call at all (then it is content)."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls, i = [], 0
    while i < len(body):
        try:
            obj, end = decoder.raw_decode(body, i)
        except ValueError:
            return text, []
        call = _call(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        i = end
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    return "", calls


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def parse_tool_calls(parser: str, text: str) -> tuple[str, list[ToolCall]]:
    try:
        fn = PARSERS[parser]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {parser!r}; known: {sorted(PARSERS)}") from None
    return fn(text)


def check_tools(tools: Any, tool_choice: Any) -> dict[str, dict]:
    """Validate ``tools`` / ``tool_choice``: name → parameters schema; ValueError naming the problem."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return {}
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list")
    out: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{type: 'function', function: {{name, parameters}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 characters of [A-Za-z0-9_.-]")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        if name in out:
            raise ValueError(f"tools[{i}]: duplicate function name {name!r}")
        out[name] = params
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(fn, dict) or fn.get("name") not in out:
            raise ValueError("tool_choice must name one of the tools: {type: 'function', function: {name}}")
    elif tool_choice not in (None, "none", "auto", "required"):
        raise ValueError(f"tool_choice must be none, auto, required or a named function, got {tool_choice!r}")
    return out


def forced_schema(functions: dict[str, dict], tool_choice: Any, parallel: bool = True) -> dict | None:
    """The JSON schema the output must follow for ``required`` / a named function (else None);
    ``parallel=False`` (OpenAI's ``parallel_tool_calls``): at most one call."""
    if isinstance(tool_choice, dict):
        return functions[tool_choice["function"]["name"]]
    if tool_choice == "required":
        return {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}), "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": n}, "parameters": p},
             "required": ["name", "parameters"], "additionalProperties": False} for n, p in functions.items()]}}
    return None


def calls_from_forced(text: str, tool_choice: Any) -> list[ToolCall]:
    """The tool calls of an output that followed :func:`forced_schema`."""
    obj = json.loads(text)
    if isinstance(tool_choice, dict):
        return [ToolCall(tool_choice["function"]["name"], json.dumps(obj, ensure_ascii=False))]
    return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in obj]
