"""Clear errors for inputs that used to give someone else's message (issue 16 item 9)."""
from __future__ import annotations

import pytest

from fxcompiler import LLM


def test_nonexistent_local_path_says_so(tmp_path):
    with pytest.raises(ValueError, match="no such file or directory"):
        LLM(str(tmp_path / "does" / "not" / "exist"))


@pytest.mark.parametrize("kwargs, match", [
    ({"kv_cache_memory_bytes": "1GB"}, "kv_cache_memory_bytes must be a positive int"),
    ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes must be a positive int"),
    ({"seed": "abc"}, r"seed must be an int in \[0, 2\*\*32\)"),
    ({"seed": 2**70}, r"seed must be an int in \[0, 2\*\*32\)"),
    ({"hf_overrides": {"num_hidden_layers": -1}}, r"hf_overrides\['num_hidden_layers'\] must be a positive int"),
    ({"hf_overrides": {"vocab_size": "big"}}, r"hf_overrides\['vocab_size'\] must be a positive int"),
])
def test_constructor_arguments_get_named_errors(llama_dir, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(llama_dir), cache_dir=tmp_path, **kwargs)


def test_encoder_model_is_refused(tmp_path):
    from transformers import BertConfig

    BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=32, architectures=["BertForMaskedLM"]).save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match="encoder or encoder-decoder model"):
        LLM(str(tmp_path / "bert"), use_random_weight=True, cache_dir=tmp_path / "c")


@pytest.mark.parametrize("messages, exc, match", [
    ([{"role": "user", "content": 5}], TypeError, "message 0: content must be a str"),
    ([{"role": "user", "content": ["a"]}], TypeError, "content must be a str"),
    ([{"role": "wizard", "content": "hi"}], ValueError, "unknown role 'wizard'"),
    ([{"role": "user", "content": "hi"}, {"role": None, "content": "x"}], ValueError, "message 1: unknown role"),
])
def test_chat_messages_are_checked(messages, exc, match):
    from fxcompiler.chat_checks import check_messages

    with pytest.raises(exc, match=match):
        check_messages(messages)


@pytest.mark.parametrize("tools, exc, match", [
    ("get_weather", TypeError, "tools must be a list"),
    ([5], TypeError, r"tools\[0\] must be a dict or a callable"),
    ([{"type": "function", "function": {"description": "no name"}}], ValueError, r"tools\[0\] must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], ValueError, "parameters must be"),
])
def test_chat_tools_are_checked(tools, exc, match):
    from fxcompiler.chat_checks import check_tools

    with pytest.raises(exc, match=match):
        check_tools(tools)
    check_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
