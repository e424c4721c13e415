"""Caches that heal: a corrupted or planted compile-cache, build-cache or edf entry is detected
before anything in it is parsed or run, removed, and rebuilt with the same greedy output."""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from fxcompiler import SamplingParams
from fxcompiler.compile_cache import CompileCache

from .conftest import PROMPTS, make_llm

SP = SamplingParams(max_tokens=8, temperature=0)


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(None, SP, prompt_token_ids=PROMPTS)]


@pytest.fixture(scope="module")
def warm(llm, rel_cache):
    """The shared LLM's cache (compile + build entries) and its greedy output."""
    key = llm.build_info["cache_key"]
    return rel_cache, key, _tokens(llm)


@pytest.fixture
def cache(warm, tmp_path):
    src, key, _ = warm
    dst = tmp_path / "cache"
    dst.mkdir(mode=0o700)
    shutil.copytree(src / "compiled" / key, dst / "compiled" / key)
    return dst


def _entry(warm, cache) -> Path:
    return CompileCache(cache).path(warm[1])


def _build_entry(warm, cache) -> Path:
    (b,) = [p for p in (_entry(warm, cache) / "builds").iterdir() if not p.name.startswith(".")]
    return b


def _payload(sentinel: Path) -> str:
    return f"open({str(sentinel)!r}, 'w').write('pwned')\n"


def _start(llama_dir, cache, caplog):
    caplog.set_level("WARNING", logger="fxcompiler.cache")
    llm = make_llm(llama_dir, cache)
    return llm


def test_intact_entries_hit(llama_dir, warm, cache, caplog):
    llm = _start(llama_dir, cache, caplog)
    try:
        assert (llm.build_info["compile_cache"], llm.build_info["build_cache"]) == ("hit", "hit")
        assert _tokens(llm) == warm[2]
    finally:
        llm.shutdown()


def test_compile_cache_graph_payload_never_runs_and_is_rebuilt(llama_dir, warm, cache, caplog, tmp_path):
    sentinel = tmp_path / "sentinel"
    g = _entry(warm, cache) / "graph.py"
    g.write_text(_payload(sentinel) + g.read_text())
    llm = _start(llama_dir, cache, caplog)
    try:
        assert not sentinel.exists()
        assert llm.build_info["compile_cache"] == "miss"
        assert "compile cache entry" in caplog.text and "sha256" in caplog.text or "size" in caplog.text
        assert _tokens(llm) == warm[2]
        assert (_entry(warm, cache) / "checksums.json").is_file()  # stored again, intact
    finally:
        llm.shutdown()


def test_compile_cache_flipped_parameter_byte_is_detected_and_rebuilt(llama_dir, warm, cache, caplog):
    p = _entry(warm, cache) / "params.safetensors"
    data = bytearray(p.read_bytes())
    data[-5] ^= 0xFF
    p.write_bytes(bytes(data))
    llm = _start(llama_dir, cache, caplog)
    try:
        assert llm.build_info["compile_cache"] == "miss"
        assert "sha256 differs" in caplog.text
        assert _tokens(llm) == warm[2]
    finally:
        llm.shutdown()


def test_build_cache_graph_payload_never_runs_and_is_rebuilt(llama_dir, warm, cache, caplog, tmp_path):
    sentinel = tmp_path / "sentinel"
    b = _build_entry(warm, cache)
    g = next((b / "graphs").glob("*.py"))
    g.write_text(_payload(sentinel) + g.read_text())
    llm = _start(llama_dir, cache, caplog)
    try:
        assert not sentinel.exists()
        assert (llm.build_info["compile_cache"], llm.build_info["build_cache"]) == ("hit", "miss")
        assert "build cache entry" in caplog.text
        assert _tokens(llm) == warm[2]
    finally:
        llm.shutdown()


class _Boom:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_planted_pickle_in_a_build_entry_is_never_unpickled(llama_dir, warm, cache, caplog, tmp_path):
    sentinel = tmp_path / "sentinel"
    b = _build_entry(warm, cache)
    (b / "pipelines.pkl").write_bytes(pickle.dumps({"schema": 1, "pipelines": [_Boom(sentinel)]}))
    llm = _start(llama_dir, cache, caplog)
    try:
        assert not sentinel.exists()
        assert llm.build_info["build_cache"] == "miss" and "not listed" in caplog.text
        assert _tokens(llm) == warm[2]
    finally:
        llm.shutdown()


def test_build_entry_records_are_json_not_pickle(warm, cache):
    b = _build_entry(warm, cache)
    assert not list(b.rglob("*.pkl"))
    json.loads((b / "pipelines.json").read_text())


def test_build_entry_without_checksums_is_rebuilt(llama_dir, warm, cache, caplog):
    (_build_entry(warm, cache) / "checksums.json").unlink()
    llm = _start(llama_dir, cache, caplog)
    try:
        assert llm.build_info["build_cache"] == "miss" and "never trusted" in caplog.text
        assert _tokens(llm) == warm[2]
    finally:
        llm.shutdown()


def test_stale_temporary_entries_of_a_killed_writer_are_cleaned(llama_dir, warm, cache, caplog):
    stale = _entry(warm, cache).parent / ".tmp-999999-deadbeef-0000"
    stale.mkdir()
    (stale / "graph.py").write_text("half written")
    from fxcompiler.compile_cache import write_entry

    write_entry(_entry(warm, cache).parent / "other", lambda tmp: tmp.mkdir(), "test")
    assert not stale.exists()
