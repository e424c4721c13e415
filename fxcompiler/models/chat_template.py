"""Chat templates rendered with jinja2 alone, as transformers renders them, without importing transformers.

Importing transformers for its renderer cost a warm start's first ``LLM.chat`` 1-2.5 s. This module
reproduces ``transformers.utils.chat_template_utils`` (5.x) for the common call — messages (dicts,
dataclasses, pydantic models), tools given as JSON-schema dicts, documents as dicts, extra template
variables, ``add_generation_prompt`` — in the same sandbox: ``ImmutableSandboxedEnvironment`` with
``trim_blocks``/``lstrip_blocks`` and loop controls, its ``tojson`` filter (no HTML escaping),
``raise_exception``, ``strftime_now``, a limited ``dict`` and a ``namespace`` refusing underscore names,
and every value the template sees rebuilt from plain JSON types. :func:`supported` says which calls it
serves; the others (tools given as Python functions, ``continue_final_message``, assistant-token masks,
``{% generation %}`` blocks) go to transformers' own renderer. ``tests/models/test_chat_template.py``
checks the output equals transformers' on the embedded model's template and on templates using every
feature listed here.

Requires: jinja2 >= 3.1.6 (older versions have sandbox escapes; transformers refuses them too).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def supported(chat_template: Any, tools: Any, documents: Any, *, continue_final_message: Any = False,
              return_assistant_tokens_mask: bool = False) -> bool:
    """Whether :func:`render` serves this call (else transformers' renderer must)."""
    if not isinstance(chat_template, str) or continue_final_message or return_assistant_tokens_mask:
        return False
    if "generation" in chat_template and "endgeneration" in chat_template:  # transformers' {% generation %} tag
        return False
    if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)):
        return False
    if documents is not None and not (isinstance(documents, (list, tuple))
                                      and all(isinstance(d, dict) for d in documents)):
        return False
    try:
        _environment()
    except ImportError:
        return False
    return True


def normalize_messages(conversation: Any) -> list[dict]:
    """transformers' ``_normalize_chat_messages``: message objects to dicts, keys whose value is None dropped."""
    messages = _objects_to_dicts(getattr(conversation, "messages", conversation))
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def render(conversations: list[list[dict]], *, chat_template: str, tools: list[dict] | None = None,
           documents: list[dict] | None = None, add_generation_prompt: bool = False, **kwargs: Any) -> list[str]:
    """The rendered text of each conversation (already normalised), as transformers' ``render_jinja_template``
    gives it for the calls :func:`supported` accepts."""
    template = _compiled(chat_template)
    tools = _plain(list(tools)) if tools is not None else None
    documents = _plain(documents)
    kwargs = _plain(kwargs)
    out = []
    for chat in conversations:
        chat = _plain(getattr(chat, "messages", chat))
        for message in chat:
            if not isinstance(message, dict):
                raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        out.append(template.render(messages=_alias_reasoning(chat), tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **kwargs))
    return out


def _alias_reasoning(chat: list) -> list:
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _objects_to_dicts(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _objects_to_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_objects_to_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_objects_to_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _objects_to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _objects_to_dicts(value.model_dump())
    return value


def _plain(value: Any) -> Any:
    """What the template may see: plain JSON types rebuilt, anything else an inert ``<TypeName>`` string."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if _is_numpy_scalar(value):  # np.bool_(False) would otherwise be a truthy placeholder
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _is_numpy_scalar(value: Any) -> bool:
    import sys

    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.generic)


@functools.lru_cache(maxsize=1)
def _environment():
    import jinja2
    import jinja2.ext
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit()) < (3, 1, 6):
        raise ImportError(f"jinja2 {jinja2.__version__} < 3.1.6 (known sandbox escapes)")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):  # noqa: A002 - the template's argument name
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute.")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


@functools.lru_cache(maxsize=16)
def _compiled(chat_template: str):
    return _environment().from_string(chat_template)
