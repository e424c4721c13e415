"""Checks of ``LLM.chat`` inputs: messages and tools, with errors naming the bad entry.

A chat template renders whatever it is given (or fails deep inside Jinja with a message
about the template, not the input); these checks name the conversation, message and field.
"""
from __future__ import annotations

from typing import Any

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "ipython", "function"})


def check_messages(conversation: list[dict], index: int = 0) -> None:
    """Each message has a known ``role`` and a ``str`` content (None only for an assistant
    message that carries ``tool_calls``)."""
    for j, m in enumerate(conversation):
        where = f"conversation {index} message {j}"
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ValueError(f"{where}: unknown role {role!r}; expected one of {sorted(CHAT_ROLES)}")
        content = m.get("content")
        if content is None and role == "assistant" and m.get("tool_calls"):
            continue
        if not isinstance(content, str):
            raise TypeError(f"{where}: content must be a str (chat_template_content_format='string'), "
                            f"got {type(content).__name__}")


def check_tools(tools: Any) -> None:
    """``tools``: None or a list of JSON-schema tool dicts (``{"type": "function", "function":
    {"name": str, ...}}`` or ``{"name": str, ...}``) or Python callables."""
    if tools is None:
        return
    if not isinstance(tools, (list, tuple)):
        raise TypeError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    for i, t in enumerate(tools):
        if callable(t):
            continue
        if not isinstance(t, dict):
            raise TypeError(f"tools[{i}] must be a dict or a callable, got {type(t).__name__}")
        fn = t.get("function", t) if t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, "
                             f"'parameters': {{...}}}}}}, got {t!r}"[:300])
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON-schema dict, got {type(params).__name__}")
