"""Sampling defaults from a model's generation_config.json (vLLM's behaviour): the server and the CLI's
``generate`` / ``chat`` take unset temperature / top_p / top_k / repetition_penalty / max tokens from it; a
value the request (or flag) sets wins; a model without the file keeps the previous defaults. End to end (a
built model whose directory has the file, the CLI and the server app): tests/serving/test_engine.py."""
from __future__ import annotations

import json

import pytest
from transformers import GenerationConfig, LlamaConfig

from fxcompiler import cli
from fxcompiler.generation_defaults import generation_defaults
from fxcompiler.models.loader import load_model_info
from fxcompiler.models.sources import resolve_model_source

# a sampling config (the CLI's own default is greedy, a completion's max_tokens 16 and the CLI's 64)
GEN = {"temperature": 1.0, "top_k": 3, "top_p": 0.9, "repetition_penalty": 1.05, "max_new_tokens": 6}
EXPECTED = {"temperature": 1.0, "top_k": 3, "top_p": 0.9, "repetition_penalty": 1.05, "max_tokens": 6}


def test_defaults_come_only_from_a_generation_config_file(tmp_path):
    with_file, without = tmp_path / "with", tmp_path / "without"
    for d in (with_file, without):
        LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2).save_pretrained(d)
    (with_file / "generation_config.json").write_text(json.dumps({**GEN, "do_sample": False}))
    info = load_model_info(resolve_model_source(with_file), cache_dir=tmp_path)
    assert generation_defaults(info.generation_config) == EXPECTED  # do_sample ignored, as in vLLM
    info = load_model_info(resolve_model_source(without), cache_dir=tmp_path)
    assert info.generation_config is not None and generation_defaults(info.generation_config) == {}
    assert generation_defaults(None) == {}
    assert generation_defaults(GenerationConfig(top_k=0, temperature=0.0)) == {"top_k": -1, "temperature": 0.0}


def test_cli_flags_win_then_the_model_then_the_cli_defaults():
    parser = cli.build_parser()
    gc = GenerationConfig(**GEN)
    sp = cli._sampling(parser.parse_args(["generate", "--seed", "3"]), gc)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.repetition_penalty, sp.max_tokens, sp.seed) == (
        1.0, 3, 0.9, 1.05, 6, 3)
    sp = cli._sampling(parser.parse_args(["chat", "--temperature", "0.5", "--max-tokens", "9", "--top-k", "-1"]), gc)
    assert (sp.temperature, sp.max_tokens, sp.top_k, sp.top_p) == (0.5, 9, -1, 0.9)
    sp = cli._sampling(parser.parse_args(["generate"]), None)  # no generation_config.json: greedy, 64 tokens
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.max_tokens) == (0.0, 1.0, -1, 1.0, 64)
    assert cli._sampling(parser.parse_args(["chat"]), GenerationConfig()).max_tokens == 256
