"""Sampling defaults from a model's generation_config.json (vLLM's behaviour): the server and the CLI's
``generate`` take unset temperature / top_p / top_k / repetition_penalty / max tokens from it; a value the
request (or flag) sets wins; a model without the file keeps the previous defaults."""
from __future__ import annotations

import json

import pytest
from transformers import GenerationConfig, LlamaConfig

from fxcompiler import LLM, SamplingParams, cli
from fxcompiler.engine_args import EngineArgs
from fxcompiler.generation_defaults import generation_defaults
from fxcompiler.models.loader import load_model_info
from fxcompiler.models.sources import resolve_model_source

from .serving.tiny_chat_model import save_tiny_chat_model

# a sampling config (the CLI's own default is greedy, a completion's max_tokens 16 and the CLI's 64)
GEN = {"temperature": 1.0, "top_k": 3, "top_p": 0.9, "repetition_penalty": 1.05, "max_new_tokens": 6}
EXPECTED = {"temperature": 1.0, "top_k": 3, "top_p": 0.9, "repetition_penalty": 1.05, "max_tokens": 6}
PROMPT = "def foo(x): return"


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


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny_chat_model(tmp_path_factory.mktemp("gencfg") / "model", generation_config=GEN)
    args = EngineArgs(model=str(path), max_seq_len_to_capture=128, threads=1, prefill_buckets=[(1, 64)],
                      decode_buckets=[(1, 128)], cache_dir=str(tmp_path_factory.mktemp("cache")))
    with LLM.from_engine_args(args) as llm:
        yield llm


def reference(llm, **kw) -> str:
    return llm.generate(PROMPT, SamplingParams(**kw))[0].outputs[0].text


def test_cli_generate_samples_with_the_models_config(llm, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_make_llm", lambda args: llm)  # the one built above
    assert cli.main(["generate", "-p", PROMPT, "--seed", "11"]) == 0
    sampled = capsys.readouterr().out
    assert f"### {PROMPT}\n{reference(llm, **EXPECTED, seed=11)}\n" in sampled
    assert cli.main(["generate", "-p", PROMPT, "--temperature", "0", "--max-tokens", "5"]) == 0
    assert f"### {PROMPT}\n{reference(llm, **{**EXPECTED, 'temperature': 0.0, 'max_tokens': 5})}\n" in \
        capsys.readouterr().out


def test_server_requests_take_unset_fields_from_the_models_config(llm):
    from fastapi.testclient import TestClient

    from fxcompiler.serving import AsyncLLMEngine, LLMEngine
    from fxcompiler.serving.api_server import build_app

    engine = AsyncLLMEngine(LLMEngine(llm))
    assert engine.engine.default_sampling_params() == EXPECTED
    try:
        with TestClient(build_app(engine, model_name="m")) as http:
            def complete(**body):
                r = http.post("/v1/completions", json={"prompt": PROMPT, "ignore_eos": True, **body})
                assert r.status_code == 200, r.text
                return r.json()

            out = complete(seed=5)  # every sampling field and max_tokens from generation_config.json
            assert out["usage"]["completion_tokens"] == 6
            assert out["choices"][0]["text"] == reference(llm, **EXPECTED, seed=5, ignore_eos=True)
            out = complete(temperature=0.0, max_tokens=4)  # what the request sets wins
            assert out["usage"]["completion_tokens"] == 4
            assert out["choices"][0]["text"] == reference(llm, **{**EXPECTED, "temperature": 0.0, "max_tokens": 4},
                                                           ignore_eos=True)
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "ignore_eos": True, "seed": 1})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
    finally:
        engine.shutdown()
