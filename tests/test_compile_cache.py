"""The compile cache: a second LLM(...) with the same settings loads the optimised program
instead of exporting and running the passes; anything that changes the program misses."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from fxcompiler import LLM, SamplingParams
from fxcompiler import testing
from fxcompiler.compile_cache import CompileCache, load_program
from fxcompiler.graph_io import graph_constants, graph_module_source, load_graph_module, restore_meta, \
    placeholder_signature
from fxcompiler.pipeline_builder import optimise

from .conftest import save_tiny_model

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 3]]
SP = SamplingParams(max_tokens=12, temperature=0)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(None, SP, prompt_token_ids=PROMPTS)]


def _llm(path, cache, **kw) -> LLM:
    return LLM(str(path), max_seq_len_to_capture=128, cache_dir=cache, **kw)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("cc") / "llama", "llama")


def test_second_build_hits_and_generates_the_same(llama, tmp_path, monkeypatch):
    first = _llm(llama, tmp_path)
    assert first.build_info["compile_cache"] == "miss"
    entry = CompileCache(tmp_path).path(first.build_info["cache_key"])
    assert {p.name for p in entry.iterdir()} >= {"program.json", "graph.py", "params.safetensors"}
    expected = _tokens(first)

    import fxcompiler.capture

    def no_export(*a, **k):
        raise AssertionError("a cache hit must not export the model")

    monkeypatch.setattr(fxcompiler.capture, "capture", no_export)
    import fxcompiler.build
    import fxcompiler.graph_io

    def no_build(*a, **k):
        raise AssertionError("a warm start must not rebuild pipelines or re-derive graph meta")

    monkeypatch.setattr(fxcompiler.build, "build_pipelines", no_build)
    monkeypatch.setattr(fxcompiler.graph_io, "restore_meta", no_build)
    assert first.build_info["build_cache"] == "miss"
    second = _llm(llama, tmp_path)
    assert second.build_info["compile_cache"] == "hit"
    assert second.build_info["build_cache"] == "hit"
    assert second.build_info["cache_key"] == first.build_info["cache_key"]
    assert [p.to_dict() for p in second.pipelines] == [p.to_dict() for p in first.pipelines]
    assert _tokens(second) == expected
    assert [h["pass"] for h in second.pass_history] == [h["pass"] for h in first.pass_history]
    from fxcompiler.graph_io import DeferredGraphModule

    deferred = second._build.graph_module  # the program's graph: never traced, the pipelines came from the cache
    assert isinstance(deferred, DeferredGraphModule) and deferred.__dict__["_gm"] is None
    monkeypatch.undo()
    def ops(gm):
        return [(n.op, str(n.target)) for n in gm.graph.nodes]

    assert ops(deferred.materialize()) == ops(first._build.graph_module)
    assert deferred.meta["fxc_signature"] and deferred.graph is deferred.materialize().graph


def test_other_buckets_reuse_the_program_but_build_their_pipelines(llama, tmp_path):
    first = _llm(llama, tmp_path)
    other = LLM(str(llama), max_seq_len_to_capture=64, cache_dir=tmp_path)
    assert (other.build_info["compile_cache"], other.build_info["build_cache"]) == ("hit", "miss")
    assert _tokens(other) == _tokens(first)
    again = LLM(str(llama), max_seq_len_to_capture=64, cache_dir=tmp_path, comp_supertask_kind="dfg")
    assert (again.build_info["compile_cache"], again.build_info["build_cache"]) == ("hit", "hit")
    assert _tokens(again) == _tokens(first)


def test_a_damaged_build_entry_is_rebuilt_with_a_warning(llama, tmp_path, caplog):
    first = _llm(llama, tmp_path)
    expected = _tokens(first)
    builds = CompileCache(tmp_path).path(first.build_info["cache_key"]) / "builds"
    (entry,) = builds.iterdir()
    (entry / "pipelines.pkl").write_bytes(b"not a pickle")
    with caplog.at_level("WARNING", logger="fxcompiler.cache"):
        second = _llm(llama, tmp_path)
    assert second.build_info["build_cache"] == "miss"
    assert any("build cache entry" in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records)
    assert _tokens(second) == expected
    assert _llm(llama, tmp_path).build_info["build_cache"] == "hit"


@pytest.fixture(scope="module")
def shared_cache(llama, tmp_path_factory):
    """A cache directory holding the default build's entry, and that entry's key."""
    cache = tmp_path_factory.mktemp("shared_cache")
    return cache, _llm(llama, cache, skip_engine=True).build_info["cache_key"]


@pytest.mark.parametrize("change", [
    {"hf_overrides": {"num_hidden_layers": 1}},
    {"dtype": "float64"},
    {"paged_attention_block_size": 8},
    {"compiler_config_overrides": {"passes": {"disable": ["cse"]}}},
    {"embed_all_constants_into_graph": True},
])
def test_what_changes_the_program_changes_the_key(llama, shared_cache, change):
    cache, base_key = shared_cache
    other = _llm(llama, cache, **change)
    assert other.build_info["compile_cache"] == "miss"
    assert other.build_info["cache_key"] != base_key
    again = _llm(llama, cache, **change)
    assert again.build_info["compile_cache"] == "hit"
    assert _tokens(again) == _tokens(other)


def test_the_tuning_thread_count_is_part_of_the_key(llama, shared_cache):
    """The lowering pass times the kernels at this process's intra-op thread count, so a program lowered
    at one count is not reused at another (a 1-thread build chose ATen where a 2-thread engine loses by 1.3x)."""
    cache, base_key = shared_cache
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    try:
        other = _llm(llama, cache, skip_engine=True)
    finally:
        torch.set_num_threads(before)
    assert other.build_info["compile_cache"] == "miss" and other.build_info["cache_key"] != base_key
    assert _llm(llama, cache, skip_engine=True).build_info["cache_key"] == base_key


def test_uncacheable_options_bypass_the_cache(llama, tmp_path, monkeypatch):
    def noop(gm, ctx):
        from fxcompiler.pass_manager import PassResult
        return PassResult(gm, False)

    llm = _llm(llama, tmp_path, compiler_config_overrides={"passes": {"insert": [noop]}})
    assert llm.build_info["compile_cache"] == "off"
    llm = _llm(llama, tmp_path, compiler_config_overrides={"dump_dir": str(tmp_path / "dumps")})
    assert llm.build_info["compile_cache"] == "off"
    assert _llm(llama, None).build_info["compile_cache"] == "off"
    monkeypatch.setenv("FXCOMPILER_COMPILE_CACHE", "0")
    assert _llm(llama, tmp_path).build_info["compile_cache"] == "off"
    assert not (tmp_path / "compiled").exists()  # (the uncacheable builds above used the capture cache)


def test_a_damaged_entry_is_rebuilt(llama, tmp_path):
    first = _llm(llama, tmp_path)
    expected = _tokens(first)
    params = CompileCache(tmp_path).path(first.build_info["cache_key"]) / "params.safetensors"
    params.write_bytes(params.read_bytes()[: params.stat().st_size // 2])
    second = _llm(llama, tmp_path)
    assert second.build_info["compile_cache"] == "miss"
    assert _tokens(second) == expected
    assert _llm(llama, tmp_path).build_info["compile_cache"] == "hit"


def test_a_warm_start_maps_verified_parameters_and_a_flipped_byte_is_rebuilt(llama, tmp_path, monkeypatch):
    """A hit maps params.safetensors (read when first touched) after verifying its checksum; the engine's
    background thread then moves it into anonymous memory. One byte changed in place (same size, so only the
    sha256 can tell) is caught before the file is mapped: the entry is rebuilt. The writer of an entry has its
    files stamped (hashed once old enough), so the first warm start need not hash them."""
    from backends.cpu import huge_pages
    from fxcompiler import integrity, param_memory

    monkeypatch.delenv("FXCOMPILER_TRUST_CACHE_DIR", raising=False)
    settled = []
    real_settle = integrity.StampStore.settle
    monkeypatch.setattr(integrity.StampStore, "settle", lambda self, paths: settled.extend(paths) or real_settle(self, paths))
    first = _llm(llama, tmp_path)
    assert CompileCache(tmp_path).path(first.build_info["cache_key"]) / "params.safetensors" in settled
    expected = _tokens(first)
    warm = _llm(llama, tmp_path)
    assert warm.build_info["compile_cache"] == "hit"
    regions = {param_memory.region_of(t) for t in warm._build.params.values()} - {None}
    assert regions and huge_pages.wait(60)
    assert not any(param_memory.region_of(t).file_backed for t in warm._build.params.values()
                   if param_memory.region_of(t) is not None)
    assert _tokens(warm) == expected
    params = CompileCache(tmp_path).path(first.build_info["cache_key"]) / "params.safetensors"
    data = bytearray(params.read_bytes())
    data[len(data) // 2] ^= 0x40
    params.write_bytes(bytes(data))
    again = _llm(llama, tmp_path)
    assert again.build_info["compile_cache"] == "miss"
    assert _tokens(again) == expected
    assert _tokens(warm) == expected  # the running engine no longer reads the file


@pytest.mark.parametrize("embed", [False, True])
def test_graph_code_round_trip(embed):
    program = testing.capture_tiny_model(testing.TinyConfig("qwen2", 2, 32, 4, 2, 97, 48))
    gm, ctx = optimise(program, {"embed_all_constants_into_graph": embed})
    constants = graph_constants(gm)
    assert bool(constants) == embed
    loaded = load_graph_module(graph_module_source(gm), constants)
    def ops(g):  # the tracer emits get_attr nodes at first use, so compare the multiset of nodes
        return Counter((n.op, str(n.target)) for n in g.graph.nodes if n.op != "get_attr")

    assert ops(loaded) == ops(gm)
    assert {n.target for n in loaded.graph.nodes if n.op == "get_attr"} == set(constants)
    inputs = testing.inputs_for_geometry(ctx.geometry, testing.TestBucket(2, 3, 5, 16))
    want, want_caches = testing.run_program(gm, ctx, inputs)
    got, got_caches = testing.run_program(loaded, ctx, inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for k in want_caches:
        torch.testing.assert_close(got_caches[k], want_caches[k], rtol=0, atol=0)
    restore_meta(loaded, placeholder_signature(gm))
    out = next(n for n in loaded.graph.nodes if n.op == "output").args[0][0]
    ref = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert out.meta["val"].dtype == ref.meta["val"].dtype
    assert out.meta["val"].dim() == 2 and out.meta["val"].shape[1] == 97


def test_load_program_rejects_other_schema(tmp_path, llama):
    llm = _llm(llama, tmp_path)
    entry = CompileCache(tmp_path).path(llm.build_info["cache_key"])
    meta = entry / "program.json"
    meta.write_text(meta.read_text().replace('"schema": 1', '"schema": 999'))
    from fxcompiler.integrity import write_checksums

    write_checksums(entry)  # a consistent entry of another schema (else the checksum check refuses it first)
    with pytest.raises(ValueError, match="schema"):
        load_program(entry)
