"""Chat templates rendered with jinja2 alone (``fxcompiler/models/chat_template.py``) equal transformers' renderer:
on the embedded model's template and on templates that use every feature the module serves (tools and documents
as JSON, tojson's options, namespaces, loop controls, dict(), raise_exception, extra variables, reasoning fields,
message objects, None-valued keys, numpy scalars); the sandbox refuses what transformers' refuses."""
from __future__ import annotations

import dataclasses

import jinja2
import numpy as np
import pytest
from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

from fxcompiler.models import chat_template as jinja_only
from fxcompiler.models.loader import load_tokenizer, model_directory
from fxcompiler.models.sources import DEFAULT_MODEL_ID, resolve_model_source

CHATS = [
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Write «héllo» in 日本語 🤖"},
     {"role": "assistant", "content": "こんにちは"},
     {"role": "user", "content": "And <|im_end|> is special?"}],
    [{"role": "user", "content": "hi", "name": None}],
    [{"role": "user", "content": "  spaced\n\nlines  "}, {"role": "assistant", "content": ""}],
    [{"role": "assistant", "content": "no user first"}],
]

FEATURES = """{%- set ns = namespace(n=0, seen=[]) -%}
{%- if tools %}<tools>{{ tools | tojson(indent=2, sort_keys=True) }}</tools>
{% endif -%}
{%- if documents %}{% for d in documents %}[doc {{ loop.index }}: {{ d.title }}] {{ d.text }}
{% endfor %}{% endif -%}
{%- for m in messages -%}
  {%- if m.role == 'skip' %}{% continue %}{% endif -%}
  {%- if m.role == 'stop' %}{% break %}{% endif -%}
  {%- set ns.n = ns.n + 1 -%}
  <|{{ m.role }}|>{% if m.content is string %}{{ m.content }}{% elif m.content is defined %}{{ m.content | tojson }}{% endif %}
  {%- if m.reasoning_content %} (thinks: {{ m.reasoning_content }} / {{ m.thinking }}){% endif %}
  {%- if m.tool_calls %} calls {{ m.tool_calls | tojson(separators=(',', ':')) }}{% endif %}
  {%- if m.name is defined %} name={{ m.name }}{% endif %}
{% endfor -%}
{{ dict(count=ns.n, flag=flag) | tojson }} {{ bos_token }}{{ extra | default('no extra') }}
{%- if add_generation_prompt %}<|assistant|>{% endif -%}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather «now»",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
DOCS = [{"title": "A", "text": "alpha"}, {"title": "B", "text": "béta"}]


@dataclasses.dataclass
class Message:
    role: str
    content: str
    reasoning: str | None = None


def _both(conversation, template, **kw):
    batched = isinstance(conversation[0], (list, tuple))
    convs = conversation if batched else [conversation]
    assert jinja_only.supported(template, kw.get("tools"), kw.get("documents"))
    ours = jinja_only.render([jinja_only.normalize_messages(c) for c in convs], chat_template=template, **kw)
    theirs, _ = render_jinja_template(conversations=[_normalize_chat_messages(c) for c in convs],
                                      chat_template=template, **kw)
    return ours, theirs


@pytest.fixture(scope="module")
def smol_template():
    from fxcompiler.llm import CACHE_DIR

    tok = load_tokenizer(model_directory(resolve_model_source(DEFAULT_MODEL_ID), CACHE_DIR))
    assert isinstance(tok.chat_template, str) and "im_start" in tok.chat_template
    return tok.chat_template, tok.special_tokens_map


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_embedded_models_template_renders_as_transformers(smol_template, add_generation_prompt):
    template, special = smol_template
    for chat in CHATS:
        ours, theirs = _both(chat, template, add_generation_prompt=add_generation_prompt, **special)
        assert ours == theirs and ours[0]
    ours, theirs = _both(CHATS[:2], template, add_generation_prompt=add_generation_prompt, **special)
    assert ours == theirs and len(ours) == 2


@pytest.mark.parametrize("tools,documents", [(None, None), (TOOLS, None), (None, DOCS), (TOOLS, DOCS)])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_a_template_using_every_served_feature_renders_as_transformers(tools, documents, add_generation_prompt):
    chat = [{"role": "system", "content": "sys"},
            {"role": "skip", "content": "hidden"},
            {"role": "user", "content": [{"type": "text", "text": "structured"}], "name": "ann"},
            Message("assistant", "ok", reasoning="because"),
            {"role": "assistant", "content": None, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Zürich"}}]},
            {"role": "user", "content": "last", "thinking": "t"},
            {"role": "stop", "content": "never shown"},
            {"role": "user", "content": "after stop"}]
    ours, theirs = _both(chat, FEATURES, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                         bos_token="<s>", flag=np.bool_(False), extra=np.float32(0.5))
    assert ours == theirs
    assert "hidden" not in ours[0] and "never shown" not in ours[0] and '"flag": false' in ours[0]


@pytest.mark.parametrize("template,error", [
    ("{{ raise_exception('no system role') }}", jinja2.exceptions.TemplateError),
    ("{% set ns = namespace(_secret=1) %}{{ ns }}", jinja2.exceptions.SecurityError),
    ("{{ messages.__class__.__mro__ }}", jinja2.exceptions.SecurityError),
    ("{{ messages.append(1) }}", jinja2.exceptions.SecurityError),
])
def test_the_sandbox_refuses_what_transformers_refuses(template, error):
    chat = [{"role": "user", "content": "x"}]
    with pytest.raises(error):
        jinja_only.render([chat], chat_template=template)
    with pytest.raises(error):
        render_jinja_template(conversations=[chat], chat_template=template)


def test_calls_it_does_not_serve_go_to_transformers():
    def tool(city: str) -> str:
        """Weather.

        Args:
            city: the city
        """
    assert not jinja_only.supported("{{ messages }}", [tool], None)
    assert not jinja_only.supported("{{ messages }}", None, None, continue_final_message=True)
    assert not jinja_only.supported("{% generation %}{{ m }}{% endgeneration %}", None, None)
    assert not jinja_only.supported({"default": "{{ messages }}"}, None, None)
    assert not jinja_only.supported("{{ messages }}", None, ["not a dict"])
    assert jinja_only.supported("{{ messages }}", TOOLS, DOCS)
