"""The capture cache: a build whose compiler options miss the compile cache reuses the export of the
same model (same graph, node names, pass history, parameters and tokens as a fresh export), and
anything that changes the export misses it."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch

from fxcompiler import LLM, SamplingParams
from fxcompiler.capture_cache import CaptureCache
from fxcompiler.graph_io import graph_module_source, load_graph_module

from .conftest import save_tiny_model

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 3]]
SP = SamplingParams(max_tokens=12, temperature=0)
NO_CSE = {"passes": {"disable": ["cse"]}}


def _llm(path, cache, **kw) -> LLM:
    return LLM(str(path), max_seq_len_to_capture=128, cache_dir=cache, **kw)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(None, SP, prompt_token_ids=PROMPTS)]


def _history(llm: LLM) -> list[dict]:
    return [{k: v for k, v in h.items() if "seconds" not in k} for h in llm.pass_history]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("capture") / "llama", "llama")


@pytest.fixture(scope="module")
def warm(llama, tmp_path_factory):
    """A cache holding the tiny llama's export, and the LLM whose build put it there."""
    cache = tmp_path_factory.mktemp("capture-cache")
    first = _llm(llama, cache)
    assert first.build_info["capture_cache"] == "miss" and first.build_info["export_seconds"] > 0
    assert len(list(CaptureCache(cache).root.iterdir())) == 1 and CaptureCache(cache).root.name == "captured"
    return cache, first


def test_other_options_reuse_the_export_and_build_what_a_fresh_export_builds(llama, warm, tmp_path, monkeypatch):
    cache, first = warm
    import fxcompiler.capture

    def no_export(*a, **k):
        raise AssertionError("a capture-cache hit must not export the model")

    with monkeypatch.context() as m:
        m.setattr(fxcompiler.capture, "capture", no_export)
        hit = _llm(llama, cache, compiler_config_overrides=NO_CSE)
    assert hit.build_info["compile_cache"] == "miss" and hit.build_info["capture_cache"] == "hit"
    assert hit.build_info["export_seconds"] == 0.0
    fresh = _llm(llama, tmp_path, compiler_config_overrides=NO_CSE)
    assert fresh.build_info["capture_cache"] == "miss"
    # node names included: the cache records them, the tracer would rename every node
    assert graph_module_source(hit._build.graph_module) == graph_module_source(fresh._build.graph_module)
    assert _history(hit) == _history(fresh)
    ph, pf = hit._build.params, fresh._build.params
    assert ph.keys() == pf.keys() and all(torch.equal(ph[k], pf[k]) for k in ph)
    assert _tokens(hit) == _tokens(fresh) == _tokens(first)


def test_builds_that_watch_the_passes_use_the_capture_cache(llama, warm, tmp_path):
    dumped = _llm(llama, warm[0], skip_engine=True, compiler_config_overrides={"dump_dir": str(tmp_path / "dumps")})
    assert dumped.build_info["compile_cache"] == "off" and dumped.build_info["capture_cache"] == "hit"
    assert any((tmp_path / "dumps").iterdir())


@pytest.mark.parametrize("change", [dict(dtype="float64"), dict(paged_attention_block_size=8),
                                    dict(hf_overrides={"rms_norm_eps": 1e-3}),
                                    dict(use_random_weight=True, seed=3)],
                         ids=["dtype", "block_size", "hf_overrides", "random_weights"])
def test_what_changes_the_export_misses(llama, warm, change):
    before = {p.name for p in (warm[0] / "captured").iterdir()}
    other = _llm(llama, warm[0], skip_engine=True, **change)
    assert other.build_info["capture_cache"] == "miss"
    assert len({p.name for p in (warm[0] / "captured").iterdir()} - before) == 1


def test_a_damaged_entry_is_exported_again_and_never_run(llama, tmp_path, caplog):
    first = _llm(llama, tmp_path)
    expected = _tokens(first)
    (entry,) = (tmp_path / "captured").iterdir()
    marker = tmp_path / "payload-ran"
    graph = entry / "graph.py"
    graph.write_text(f"open({str(marker)!r}, 'w').close()\n" + graph.read_text())
    with caplog.at_level(logging.WARNING, logger="fxcompiler.cache"):
        again = _llm(llama, tmp_path, compiler_config_overrides=NO_CSE)
    assert not marker.exists(), "the tampered graph code ran before verification"
    assert again.build_info["capture_cache"] == "miss"
    assert any("capture cache entry" in r.getMessage() for r in caplog.records)
    assert _tokens(again) == expected
    shutil.rmtree(tmp_path / "compiled")
    assert _llm(llama, tmp_path, skip_engine=True).build_info["capture_cache"] == "hit"  # rewritten whole


def test_disabled_with_the_compile_cache(llama, tmp_path, monkeypatch):
    monkeypatch.setenv("FXCOMPILER_COMPILE_CACHE", "0")
    assert _llm(llama, tmp_path, skip_engine=True).build_info["capture_cache"] == "off"
    assert not (tmp_path / "captured").exists()


def test_node_names_survive_the_round_trip_and_bad_names_are_refused():
    g = torch.fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    first = g.create_node("call_function", torch.ops.aten.add.Tensor, (x, y), name="first")
    second = g.create_node("call_function", torch.ops.aten.mul.Tensor, (first, first), name="second")
    g.output(second)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    names = [n.name for n in gm.graph.nodes]
    source = graph_module_source(gm)
    assert [n.name for n in load_graph_module(source).graph.nodes] != names  # the tracer renames
    back = load_graph_module(source, node_names=names)
    assert [n.name for n in back.graph.nodes] == names
    a, b = torch.randn(3), torch.randn(3)
    assert torch.equal(back(a, b), (a + b) * (a + b))
    with pytest.raises(ValueError, match="one per node"):
        load_graph_module(source, node_names=names[:-1])
    with pytest.raises(ValueError, match="one per node"):
        load_graph_module(source, node_names=names[:-2] + ["x", "output"])  # a duplicate
    with pytest.raises(ValueError, match="placeholder 'x'"):
        load_graph_module(source, node_names=["z"] + names[1:])
