"""Model-info cache: the cached config views and the tokenizers-backed tokenizer answer as transformers does.

Compared on the embedded model (SmolLM2-135M-Instruct): encode/decode of tricky text (unicode, special
tokens), chat-template rendering, incremental detokenization; the warm path imports no transformers; a
damaged, foreign or old entry is rebuilt with a logged reason, never trusted.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fxcompiler.models.info_cache import (DIRECTORY, ConfigView, load_model_and_tokenizer, probe_differences,
                                          store_entry)
from fxcompiler.models.light_tokenizer import LightTokenizer
from fxcompiler.models.loader import hf_config, load_model_info, load_tokenizer, model_directory
from fxcompiler.models.sources import DEFAULT_MODEL_ID, resolve_model_source
from runtime.detokenizer import IncrementalDetokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "Hello, world!",
    " leading space, trailing space ",
    "naïve café — 日本語 🤖👩‍👩‍👧 zero\u200bwidth, Ελληνικά, עברית",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special inside<|endoftext|>text<|im_end|>",
    "don't , . ? ! 're 've 'm n't",
    "\n\n\t  code:\n    return {'a': [1, 2]}  # ok",
]
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write «héllo» in 日本語 🤖"},
        {"role": "assistant", "content": "こんにちは"},
        {"role": "user", "content": "And <|im_end|> is special?"}]


@pytest.fixture(scope="module")
def smol_dir():
    from fxcompiler.llm import CACHE_DIR

    return model_directory(resolve_model_source(DEFAULT_MODEL_ID), CACHE_DIR)


@pytest.fixture(scope="module")
def both(smol_dir, tmp_path_factory):
    """(cold result, warm result, transformers tokenizer) of one cache folder."""
    cache = tmp_path_factory.mktemp("info")
    source = resolve_model_source(str(smol_dir))
    cold = load_model_and_tokenizer(source, cache_dir=cache)
    warm = load_model_and_tokenizer(source, cache_dir=cache)
    return cold, warm, load_tokenizer(smol_dir), cache


def test_warm_load_serves_views_and_light_tokenizer(both):
    (cold_info, cold_tok), (warm_info, warm_tok), _, _ = both
    assert not isinstance(cold_info.config, ConfigView) and not isinstance(cold_tok, LightTokenizer)
    assert isinstance(warm_info.config, ConfigView) and isinstance(warm_info.generation_config, ConfigView)
    assert isinstance(warm_tok, LightTokenizer)
    assert warm_info.model_dir == cold_info.model_dir


def test_config_views_equal_transformers(both):
    (cold_info, _), (warm_info, _), _, _ = both
    for view, real in ((warm_info.config, cold_info.config), (warm_info.generation_config,
                                                               cold_info.generation_config)):
        values = view.__dict__["_values"]
        assert len(values) > 10
        for name, value in values.items():
            assert getattr(real, name) == value and type(getattr(real, name)) is type(value), name
        assert view.__dict__["_real"] is None  # attribute reads did not load transformers
    cfg = warm_info.config
    for name in ("max_position_embeddings", "num_hidden_layers", "vocab_size", "tie_word_embeddings", "dtype",
                 "rope_parameters", "eos_token_id", "model_type", "architectures"):
        assert getattr(cfg, name) == getattr(cold_info.config, name), name
    assert getattr(warm_info.generation_config, "_from_model_config") == cold_info.generation_config._from_model_config
    with pytest.raises(AttributeError):
        cfg.no_such_attribute  # noqa: B018 - not an attribute of LlamaConfig either: no load
    assert getattr(cfg, "n_positions", None) is None
    assert cfg.__dict__["_real"] is None
    assert cfg.to_dict() == cold_info.config.to_dict()  # a method: the transformers config answers
    assert type(hf_config(cfg)) is type(cold_info.config)


def test_a_view_keeps_attributes_set_on_it(both, smol_dir):
    _, _, _, cache = both
    info, _ = load_model_and_tokenizer(resolve_model_source(str(smol_dir)), cache_dir=cache)
    info.config.max_position_embeddings = 1234
    assert info.config.max_position_embeddings == 1234
    assert hf_config(info.config).max_position_embeddings == 1234  # applied when transformers' loads


@pytest.mark.parametrize("special", [True, False])
def test_encode_equals_transformers(both, special):
    _, (_, light), hf, _ = both
    for text in TEXTS:
        assert light(text, add_special_tokens=special)["input_ids"] == hf(text, add_special_tokens=special)["input_ids"]
        assert light.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
    assert light(TEXTS)["input_ids"] == hf(TEXTS)["input_ids"]
    assert light("x").input_ids == hf("x").input_ids


def test_decode_equals_transformers(both):
    _, (_, light), hf, _ = both
    for text in TEXTS:
        ids = hf(text)["input_ids"]
        for skip in (True, False):
            for clean in (None, True, False):
                assert light.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean) == \
                    hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean)
            for n in range(len(ids) + 1):  # cut inside multi-byte characters
                assert light.decode(ids[:n], skip_special_tokens=skip) == hf.decode(ids[:n], skip_special_tokens=skip)
    assert light.decode(hf.all_special_ids[0]) == hf.decode(hf.all_special_ids[0])
    for attr in ("eos_token", "eos_token_id", "bos_token", "pad_token_id", "unk_token", "all_special_ids",
                 "all_special_tokens", "special_tokens_map", "chat_template", "model_max_length"):
        assert getattr(light, attr) == getattr(hf, attr), attr
    assert len(light) == len(hf) and light.vocab_size == hf.vocab_size and light.get_vocab() == hf.get_vocab()
    assert light.__dict__["_hf"] is None  # none of the above loaded transformers' tokenizer


@pytest.mark.parametrize("kwargs", [dict(add_generation_prompt=True), dict(add_generation_prompt=False),
                                    dict(continue_final_message=True)])
def test_chat_template_equals_transformers(both, kwargs):
    _, (_, light), hf, _ = both
    for chat in (CHAT, CHAT[1:], CHAT[:3], CHAT[1:2]):
        if kwargs.get("continue_final_message") and chat[-1]["role"] != "assistant":
            continue
        assert light.apply_chat_template(chat, tokenize=False, **kwargs) == \
            hf.apply_chat_template(chat, tokenize=False, **kwargs)
    assert light.apply_chat_template([CHAT, CHAT[1:2]], tokenize=False, **kwargs) == \
        hf.apply_chat_template([CHAT, CHAT[1:2]], tokenize=False, **kwargs)
    assert light.__dict__["_hf"] is None


def test_uses_beyond_the_backend_load_transformers_tokenizer(both, smol_dir):
    _, _, hf, cache = both
    _, light = load_model_and_tokenizer(resolve_model_source(str(smol_dir)), cache_dir=cache)
    assert light.__dict__["_hf"] is None
    ids = light.apply_chat_template(CHAT[1:2], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids) == list(hf.apply_chat_template(CHAT[1:2], add_generation_prompt=True, tokenize=True,
                                                    return_dict=False))
    assert light.convert_ids_to_tokens([1, 2, 3]) == hf.convert_ids_to_tokens([1, 2, 3])
    assert type(light.hf_tokenizer) is type(hf)


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_equals_transformers(both, skip):
    _, (_, light), hf, _ = both
    prompt = hf.apply_chat_template(CHAT[1:2], tokenize=False, add_generation_prompt=True)
    prompt_ids = hf(prompt, add_special_tokens=False)["input_ids"]
    out = hf(" ".join(TEXTS) + "<|im_end|>", add_special_tokens=False)["input_ids"]
    streams = []
    for tok in (hf, light):
        d = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
        deltas = [d.push([t]) for t in out] + [d.flush()]
        streams.append((deltas, d.text))
    assert streams[0] == streams[1]
    assert streams[1][1] == hf.decode(out, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_probes_catch_a_differing_tokenizer(both):
    _, (_, light), hf, _ = both
    assert probe_differences(hf, light) == []
    meta = dict(light.__dict__["_meta"], eos_token_id=0)
    wrong = LightTokenizer(light.backend_tokenizer, meta, lambda: hf)
    assert any(d.startswith("eos_token_id") for d in probe_differences(hf, wrong))
    from tokenizers import Tokenizer

    other = Tokenizer.from_str(light.backend_tokenizer.to_str())
    other.add_special_tokens(["<extra-special>"])
    assert probe_differences(hf, LightTokenizer(other, light.__dict__["_meta"], lambda: hf))


def test_a_tokenizer_failing_the_probes_is_cached_as_transformers(smol_dir, tmp_path, monkeypatch):
    import fxcompiler.models.info_cache as info_cache

    source = resolve_model_source(str(smol_dir))
    monkeypatch.setattr(info_cache, "probe_differences", lambda hf, light: ["eos_token_id: 2 != 0"])
    load_model_and_tokenizer(source, cache_dir=tmp_path)
    entry = next((tmp_path / DIRECTORY).iterdir())
    assert json.loads((entry / "snapshot.json").read_text())["tokenizer"] == "transformers"
    assert not (entry / "tokenizer.json").exists()
    info, tok = load_model_and_tokenizer(source, cache_dir=tmp_path)
    assert isinstance(info.config, ConfigView) and not isinstance(tok, LightTokenizer)


def _entry(cache: Path) -> Path:
    (entry,) = list((cache / DIRECTORY).iterdir())
    return entry


@pytest.mark.parametrize("damage", ["snapshot", "tokenizer", "checksums", "schema", "planted"])
def test_a_damaged_entry_is_rebuilt_with_a_warning(smol_dir, tmp_path, caplog, damage):
    source = resolve_model_source(str(smol_dir))
    load_model_and_tokenizer(source, cache_dir=tmp_path)
    entry = _entry(tmp_path)
    if damage == "snapshot":  # a value changed: the checksum no longer matches
        snap = json.loads((entry / "snapshot.json").read_text())
        snap["config"]["values"]["max_position_embeddings"] = 10**6
        (entry / "snapshot.json").write_text(json.dumps(snap))
    elif damage == "tokenizer":
        with open(entry / "tokenizer.json", "a") as f:
            f.write(" ")
    elif damage == "checksums":
        (entry / "checksums.json").unlink()
    elif damage == "schema":  # an entry of another snapshot format, checksums rewritten to match
        from fxcompiler.integrity import write_checksums

        snap = json.loads((entry / "snapshot.json").read_text())
        snap["schema"] = 0
        (entry / "snapshot.json").write_text(json.dumps(snap))
        write_checksums(entry)
    else:
        (entry / "extra.py").write_text("print('planted')")
    with caplog.at_level("WARNING", logger="fxcompiler.models"):
        info, tok = load_model_and_tokenizer(source, cache_dir=tmp_path)
    assert any("model-info cache entry" in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records)
    assert not isinstance(info.config, ConfigView)  # loaded by transformers
    assert info.config.max_position_embeddings == 8192
    info, tok = load_model_and_tokenizer(source, cache_dir=tmp_path)  # rebuilt: served again
    assert isinstance(info.config, ConfigView) and isinstance(tok, LightTokenizer)
    assert info.config.max_position_embeddings == 8192


def test_an_entry_without_snapshot_is_removed(smol_dir, tmp_path, caplog):
    source = resolve_model_source(str(smol_dir))
    load_model_and_tokenizer(source, cache_dir=tmp_path)
    entry = _entry(tmp_path)
    (entry / "snapshot.json").unlink()
    with caplog.at_level("WARNING", logger="fxcompiler.models"):
        info, _ = load_model_and_tokenizer(source, cache_dir=tmp_path)
    assert any("has no snapshot.json" in r.getMessage() for r in caplog.records)
    assert not isinstance(info.config, ConfigView)


def test_bypassed_for_overrides_user_tokenizers_and_disabled_cache(smol_dir, tmp_path, monkeypatch):
    source = resolve_model_source(str(smol_dir))
    info, _ = load_model_and_tokenizer(source, cache_dir=tmp_path, hf_overrides={"max_position_embeddings": 4096})
    assert info.config.max_position_embeddings == 4096 and not (tmp_path / DIRECTORY).exists()
    load_model_and_tokenizer(source, cache_dir=tmp_path, tokenizer=str(smol_dir))
    assert not (tmp_path / DIRECTORY).exists()
    monkeypatch.setenv("FXCOMPILER_COMPILE_CACHE", "0")
    load_model_and_tokenizer(source, cache_dir=tmp_path)
    assert not (tmp_path / DIRECTORY).exists()


def test_a_model_without_tokenizer(tiny_models, tmp_path):
    source = resolve_model_source(str(tiny_models["llama"]))
    cold, tok = load_model_and_tokenizer(source, cache_dir=tmp_path)
    assert tok is None
    warm, tok = load_model_and_tokenizer(source, cache_dir=tmp_path)
    assert tok is None and isinstance(warm.config, ConfigView)
    assert warm.config.hidden_size == 64 and warm.config.num_key_value_heads == 2
    assert load_model_info(source, cache_dir=tmp_path).config.to_dict() == warm.config.to_dict()


def test_warm_path_imports_no_transformers(both, smol_dir):
    _, _, _, cache = both
    code = ("import sys\nfrom fxcompiler import LLM, SamplingParams\n"
            "from fxcompiler.models.info_cache import load_model_and_tokenizer\n"
            "from fxcompiler.models.sources import resolve_model_source\n"
            "assert 'transformers' not in sys.modules, 'import fxcompiler'\n"
            f"info, tok = load_model_and_tokenizer(resolve_model_source({str(smol_dir)!r}), cache_dir={str(cache)!r})\n"
            "assert type(tok).__name__ == 'LightTokenizer'\n"
            "tok.decode(tok('héllo <|im_end|>')['input_ids'], skip_special_tokens=True)\n"
            "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False, add_generation_prompt=True)\n"
            "assert 'transformers' not in sys.modules, sorted(m for m in sys.modules if 'transformers' in m)[:5]\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_store_entry_keeps_an_existing_entry(both, smol_dir):
    (cold_info, cold_tok), _, _, cache = both
    entry = _entry(cache)
    before = (entry / "checksums.json").read_text()
    store_entry(entry, cold_info, cold_tok)  # a concurrent writer got there first: kept as it is
    assert (entry / "checksums.json").read_text() == before


async def _deltas(llm, prompt, params) -> list[str]:
    return [d async for d in llm.stream_generate(prompt, params)]


@pytest.mark.slow
def test_generation_equals_with_either_tokenizer(smol_dir, tmp_path):
    """Greedy tokens, chat rendering, incremental text, special tokens and stop strings through the engine:
    the same with the tokenizers-backed tokenizer as with transformers' (one LLM, its tokenizer swapped)."""
    from fxcompiler import LLM, SamplingParams

    llm = LLM(DEFAULT_MODEL_ID)
    try:
        _, light = load_model_and_tokenizer(resolve_model_source(str(smol_dir)), cache_dir=tmp_path)
        _, light = load_model_and_tokenizer(resolve_model_source(str(smol_dir)), cache_dir=tmp_path)
        assert isinstance(light, LightTokenizer)
        hf = load_tokenizer(smol_dir)
        chats = [CHAT[:2], [{"role": "user", "content": "List three colours, one per line."}]]
        params = [SamplingParams(temperature=0, max_tokens=16, skip_special_tokens=False, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=16, stop=["\n", "."], include_stop_str_in_output=True),
                  SamplingParams(temperature=0, max_tokens=16, stop=[" the", ","])]
        results = []
        for tok in (hf, light):
            llm.tokenizer = llm.engine.tokenizer = tok
            runs = []
            for p in params:
                outs = llm.chat(chats, p)
                runs.append([(o.prompt, o.prompt_token_ids, c.text, c.token_ids, c.finish_reason, c.stop_reason)
                             for o in outs for c in o.outputs])
            results.append((runs, asyncio.run(_deltas(llm, CHAT[1]["content"] + " 🤖", params[0]))))
        assert results[0] == results[1]
        assert any(c[2] for run in results[1][0] for c in run)  # text was generated
    finally:
        llm.shutdown()


def test_a_backend_that_fails_to_build_falls_back_to_transformers(both, caplog):
    from fxcompiler.models.light_tokenizer import Deferred

    _, (_, light), hf, _ = both

    def broken():
        raise ValueError("bad tokenizer.json")

    tok = LightTokenizer(Deferred(broken), light.__dict__["_meta"], lambda: hf)
    with caplog.at_level("WARNING", logger="fxcompiler.models"):
        assert tok("héllo")["input_ids"] == hf("héllo")["input_ids"]
    assert any("did not load" in r.getMessage() for r in caplog.records)
