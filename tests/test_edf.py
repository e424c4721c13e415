"""edf supertasks: fx blobs compiled into AOTInductor packages (fxcompiler/edf.py, backends/edf.py).

One tiny 2-layer Llama (every parameter matmul forced onto ``fxc::linear``, so the packages
exercise the extern fxc calls as SmolLM2's do), one prefill and one decode bucket: 3 unique
blobs (embedding, block, head), each compiled once (~10-20 s each with g++ on this machine; the first AOTInductor
compile in a fresh inductor cache also builds its precompiled header, ~40 s), so the file is
marked slow (the missing-compiler test is fast).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxcompiler import testing
from fxcompiler.pipeline import SuperTaskKind


def _forced_lowering() -> dict:
    """compiler_config_overrides putting every parameter matmul on fxc::linear (the tuner would
    keep the tiny shapes on ATen)."""
    from fxcompiler.pass_manager import get_pass

    return {"passes": {"disable": ["lower_cpu_kernels"],
                       "insert": [(get_pass("lower_cpu_kernels", force=True), {"after": "fuse_projections"})]}}


def _fxc_calls(gm: torch.fx.GraphModule) -> list[str]:
    return [n.target._schema.name.removeprefix("fxc::") for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "fxc"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from fxcompiler import LLM, ManualBucketConfig
    from fxcompiler.edf import to_edf_pipelines
    from tests.conftest import save_tiny_model

    root = tmp_path_factory.mktemp("edf")
    path = save_tiny_model(root / "llama", "llama", num_hidden_layers=2)
    llm = LLM(str(path), max_seq_len_to_capture=32, cache_dir=None, skip_engine=True,
              bucket_config=ManualBucketConfig([(1, 16)], [(2, 32)]), compiler_config_overrides=_forced_lowering())
    llm.test_model_path = path
    cache_dir = root / "cache"
    stats: dict = {}
    edf_pipes = to_edf_pipelines(llm.pipelines, cache_dir, stats=stats)
    return llm, edf_pipes, cache_dir, stats


@pytest.mark.slow
def test_edf_logits_match_fx_and_blocks_compile_once(built):
    from backends import get_backend
    from fxcompiler.edf import EdfPackage

    llm, edf_pipes, cache_dir, stats = built
    pipes = llm.pipelines
    fx_blobs = {b for p in pipes for b in p.blobs}
    assert len(fx_blobs) == 3  # embedding, one block blob shared by both layers and both buckets, head
    assert stats["compiled"] == 3 and stats.get("cached", 0) == 0
    assert len(list((Path(cache_dir) / "edf").glob("*.pt2"))) == 3
    for p, e in zip(pipes, edf_pipes):
        assert [t.kind for t in e.supertasks.values()] == [
            SuperTaskKind.EDF if t.kind is SuperTaskKind.FX else t.kind for t in p.supertasks.values()]
        assert all(isinstance(b.graph, EdfPackage) and b.kind == "edf" for b in e.blobs.values())
        blocks = [t.data_blob for t in e.supertasks.values() if t.kind is SuperTaskKind.EDF][1:-1]
        assert len(blocks) == 2 and len(set(blocks)) == 1
    assert {p.bucket.is_prefill for p in pipes} == {True, False}
    for p, e in zip(pipes, edf_pipes):
        fx_exe = get_backend("fx", "cpu")(p, llm._build.params, torch.device("cpu"))
        edf_exe = get_backend("edf", "cpu")(e, llm._build.params, torch.device("cpu"))
        assert edf_exe.user_inputs == fx_exe.user_inputs
        b = p.bucket
        tb = testing.TestBucket(b.batch_size, b.input_ids_size, b.kv_cache_size, p.metadata["block_size"])
        inputs = testing.inputs_for_geometry(llm.geometry, tb)
        targets = p.metadata["inputs"]
        args_fx = [inputs[targets[n]].clone() for n in fx_exe.user_inputs]
        args_edf = [inputs[targets[n]].clone() for n in edf_exe.user_inputs]
        with torch.inference_mode():
            out_fx, out_edf = fx_exe(*args_fx), edf_exe(*args_edf)
        assert out_edf.shape == out_fx.shape
        torch.testing.assert_close(out_edf, out_fx, atol=1e-5, rtol=1e-5)
        for a, c, orig in zip(args_fx, args_edf, (inputs[targets[n]] for n in fx_exe.user_inputs)):
            torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-5)  # KV caches written in place alike
        assert any(not torch.equal(a, o) for a, o in zip(args_edf, (inputs[targets[n]] for n in edf_exe.user_inputs)))
    with pytest.raises(NotImplementedError, match="edf compute supertasks"):
        get_backend("edf", "cpu")(pipes[0], llm._build.params, torch.device("cpu"))


@pytest.mark.slow
def test_edf_packages_call_the_fxc_kernels(built):
    """On CPU the packages keep fxc::linear and fxc::paged_attention as extern calls (proxy
    executor, listed in the package's extern-kernel JSON) and compile the fused elementwise ops
    (and the head views and rope of fxc::qkv_paged_attention) from their ATen references; at run time those calls reach the dispatcher once per op per
    call, as many as the fx graphs make."""
    from backends import get_backend
    from backends.cpu import kernels_available
    from fxcompiler.edf import EXTERN_OPS, extern_kernel_calls

    llm, edf_pipes, _, _ = built
    assert set(EXTERN_OPS["cpu"]) == {"linear", "linear_w8", "linear_w4", "linear_f8", "linear_w8a8", "linear_w4a8",
                                      "linear_f8f8", "linear_by_m", "paged_attention"}
    p, e = next((p, e) for p, e in zip(llm.pipelines, edf_pipes) if not p.bucket.is_prefill)
    keys = [k for k, t in p.supertasks.items() if t.data_blob is not None]
    block_calls = None
    for k in keys:
        fx_graph = p.blobs[p.supertasks[k].data_blob].graph
        calls = extern_kernel_calls(e.blobs[e.supertasks[k].data_blob].graph.path)
        # a fused qkv_paged_attention becomes ATen head views and rope around a kept paged_attention call, a
        # linear with its fused residual add (fxc::linear_add) a kept fxc::linear call and an ATen add
        kept = [c.removeprefix("qkv_").removesuffix("_add") if c in ("qkv_paged_attention", "linear_add",
                                                                    "linear_by_m_add") else c
                for c in _fxc_calls(fx_graph)]
        expected = [f"fxc::{c}" for c in kept if c in EXTERN_OPS["cpu"]]
        assert calls == expected, k
        if "fxc::paged_attention" in calls:
            block_calls = calls
    assert block_calls is not None
    if kernels_available():  # forced lowering put qkv, o, gate/up and down on fxc::linear
        assert block_calls == ["fxc::linear", "fxc::paged_attention", "fxc::linear", "fxc::linear", "fxc::linear"]

    # ... and the compiled code really calls them: dispatcher events per executable call
    params = llm._build.params
    fx_exe = get_backend("fx", "cpu")(p, params, torch.device("cpu"))
    edf_exe = get_backend("edf", "cpu")(e, params, torch.device("cpu"))
    b = p.bucket
    inputs = testing.inputs_for_geometry(llm.geometry, testing.TestBucket(b.batch_size, b.input_ids_size,
                                                                          b.kv_cache_size, p.metadata["block_size"]))
    targets = p.metadata["inputs"]

    def fxc_events(exe) -> dict[str, int]:
        args = [inputs[targets[n]].clone() for n in exe.user_inputs]
        with torch.inference_mode(), torch.profiler.profile() as prof:
            exe(*args)
        return {ev.key: ev.count for ev in prof.key_averages() if ev.key.startswith("fxc::")}

    fx_counts, edf_counts = fxc_events(fx_exe), fxc_events(edf_exe)
    layers = llm.geometry.num_layers
    # the fx graph's fused op vs the package's kept attention op around Inductor's head views and rope
    assert edf_counts.get("fxc::paged_attention") == fx_counts["fxc::qkv_paged_attention"] == layers
    # fxc::linear_add: a kept fxc::linear call and Inductor's add
    assert edf_counts.get("fxc::linear", 0) == fx_counts.get("fxc::linear", 0) + fx_counts.get("fxc::linear_add", 0)
    assert not {"fxc::rms_norm", "fxc::silu_mul", "fxc::rope"} & set(edf_counts)  # Inductor's code, not calls


def test_edf_extern_ops_policy_and_package_key():
    """Which fxc ops stay calls is per device kind (CPU: the kernels; CUDA: none, all ATen), it
    is part of the package key, and the ATen rewrite leaves kept ops alone."""
    from fxcompiler import edf
    from fxcompiler.ops.linear import pack_linear_weight

    assert edf.extern_ops("cpu") == ("linear", "linear_w8", "linear_w4", "linear_f8", "linear_w8a8", "linear_w4a8",
                                     "linear_f8f8", "linear_by_m", "paged_attention")
    assert edf.extern_ops("cuda") == ()

    class M(torch.nn.Module):
        def forward(self, x, w, g):
            h = torch.ops.fxc.rms_norm.default(x, g, 1e-6)
            return (torch.ops.fxc.linear.default(h, w, None, 8),)

    gm = torch.fx.symbolic_trace(M())
    x, w, g = torch.randn(2, 8), pack_linear_weight(torch.randn(8, 8)), torch.ones(8)
    for n, v in zip((n for n in gm.graph.nodes if n.op == "placeholder"), (x, w, g)):
        n.meta["val"] = v
    kept = edf.aten_graph_module(gm, ("linear",))
    assert _fxc_calls(kept) == ["linear"]
    assert _fxc_calls(edf.aten_graph_module(gm)) == []
    torch.testing.assert_close(kept(x, w, g)[0], gm(x, w, g)[0])
    keys = {edf.package_key(gm, "cpu"), edf.package_key(gm, "cuda"), edf.package_key(gm, "cpu", extern=()),
            edf.package_key(gm, "cpu", extern=("linear",))}
    assert len(keys) == 4
    assert edf.package_key(gm, "cpu") == edf.package_key(gm, "cpu", extern=edf.extern_ops("cpu"))

    # fxc::linear_by_m (lower_cpu_kernels' per-M-range choice): kept, or rewritten to the ATen op on its
    # dense weight (the same function for every M)
    class ByM(torch.nn.Module):
        def forward(self, x, wp, wd, b):
            return (torch.ops.fxc.linear_by_m.default(x, wp, wd, True, b, 8, [0, 1]),)

    gm = torch.fx.symbolic_trace(ByM())
    wd = torch.randn(8, 8)
    args = (torch.randn(3, 8), pack_linear_weight(wd.t().contiguous()), wd, torch.randn(8))
    for n, v in zip((n for n in gm.graph.nodes if n.op == "placeholder"), args):
        n.meta["val"] = v
    assert _fxc_calls(edf.aten_graph_module(gm, edf.extern_ops("cpu"))) == ["linear_by_m"]
    aten_only = edf.aten_graph_module(gm)
    assert _fxc_calls(aten_only) == []
    torch.testing.assert_close(aten_only(*args)[0], args[0] @ wd + args[3])

    # fxc::linear_f8 (fp8 weights): kept on CPU, or its upcast reference
    from fxcompiler.ops.quant_linear import quantize_linear_weight_fp8

    class F8(torch.nn.Module):
        def forward(self, x, q, s):
            return (torch.ops.fxc.linear_f8.default(x, q, s, None, 8),)

    gm = torch.fx.symbolic_trace(F8())
    args = (torch.randn(3, 8), *quantize_linear_weight_fp8(torch.randn(8, 8)))
    for n, v in zip((n for n in gm.graph.nodes if n.op == "placeholder"), args):
        n.meta["val"] = v
    assert _fxc_calls(edf.aten_graph_module(gm, edf.extern_ops("cpu"))) == ["linear_f8"]
    aten_only = edf.aten_graph_module(gm)
    assert _fxc_calls(aten_only) == []
    torch.testing.assert_close(aten_only(*args)[0], gm(*args)[0], rtol=1e-5, atol=1e-5)

    # fxc::linear_w8a8 (W8A8): kept on CPU, or its ATen reference (the same value bit for bit)
    from fxcompiler.ops.w8a8_linear import quantize_w8a8_weight

    class W8A8(torch.nn.Module):
        def forward(self, x, q, s, su):
            return (torch.ops.fxc.linear_w8a8.default(x, q, s, su, None, 8),)

    gm = torch.fx.symbolic_trace(W8A8())
    args = (torch.randn(3, 8), *quantize_w8a8_weight(torch.randn(8, 8)))
    for n, v in zip((n for n in gm.graph.nodes if n.op == "placeholder"), args):
        n.meta["val"] = v
    assert _fxc_calls(edf.aten_graph_module(gm, edf.extern_ops("cpu"))) == ["linear_w8a8"]
    aten_only = edf.aten_graph_module(gm)
    assert _fxc_calls(aten_only) == []
    assert torch.equal(aten_only(*args)[0], gm(*args)[0])

    # fxc::linear_w4a8 (W4A8) likewise
    from fxcompiler.ops.quant_linear import quantize_linear_weight_int4, unpack_int4
    from fxcompiler.ops.w4a8_linear import pack_w4a8

    class W4A8(torch.nn.Module):
        def forward(self, x, q, s, m):
            return (torch.ops.fxc.linear_w4a8.default(x, q, s, m, None, 8, 8),)

    gm = torch.fx.symbolic_trace(W4A8())
    args = (torch.randn(3, 16), *pack_w4a8(*unpack_int4(*quantize_linear_weight_int4(torch.randn(8, 16), 8), 8), 8))
    for n, v in zip((n for n in gm.graph.nodes if n.op == "placeholder"), args):
        n.meta["val"] = v
    assert _fxc_calls(edf.aten_graph_module(gm, edf.extern_ops("cpu"))) == ["linear_w4a8"]
    aten_only = edf.aten_graph_module(gm)
    assert _fxc_calls(aten_only) == []
    assert torch.equal(aten_only(*args)[0], gm(*args)[0])

    # fxc::linear_w4a8_silu_mul (the fused gated MLP): its linear stays a call, the silu product is ATen
    class W4A8SiluMul(torch.nn.Module):
        def forward(self, x, q, s, m):
            return (torch.ops.fxc.linear_w4a8_silu_mul.default(x, q, s, m, None, 32, 8),)

    gm = torch.fx.symbolic_trace(W4A8SiluMul())
    args = (torch.randn(3, 16), *pack_w4a8(*unpack_int4(*quantize_linear_weight_int4(torch.randn(32, 16), 8), 32), 8))
    for n, v in zip((n for n in gm.graph.nodes if n.op == "placeholder"), args):
        n.meta["val"] = v
    from torch.fx.experimental.proxy_tensor import make_fx

    kept = edf.aten_graph_module(gm, edf.extern_ops("cpu"))
    assert _fxc_calls(make_fx(kept)(*args)) == ["linear_w4a8"]  # what export traces the package from
    aten_only = edf.aten_graph_module(gm)
    assert _fxc_calls(make_fx(aten_only)(*args)) == []
    assert torch.allclose(kept(*args)[0], gm(*args)[0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(aten_only(*args)[0], gm(*args)[0], rtol=1e-5, atol=1e-6)

    # fxc::linear_w4a8_add (a projection and its residual add): the linear stays a call, the add is ATen
    class W4A8Add(torch.nn.Module):
        def forward(self, x, q, s, m, r):
            return (torch.ops.fxc.linear_w4a8_add.default(x, q, s, m, None, r, 32, 8),)

    gm = torch.fx.symbolic_trace(W4A8Add())
    args = (*args, torch.randn(3, 32))
    for n, v in zip((n for n in gm.graph.nodes if n.op == "placeholder"), args):
        n.meta["val"] = v
    kept = edf.aten_graph_module(gm, edf.extern_ops("cpu"))
    assert _fxc_calls(make_fx(kept)(*args)) == ["linear_w4a8"]
    aten_only = edf.aten_graph_module(gm)
    assert _fxc_calls(make_fx(aten_only)(*args)) == []
    assert torch.equal(kept(*args)[0], gm(*args)[0])
    assert torch.equal(aten_only(*args)[0], gm(*args)[0])


def test_w8_and_w4_linears_and_their_epilogue_fusions_keep_the_linear_as_the_extern_call():
    """``fxc::linear_w4`` and the epilogue fusions of W8 and W4 linears (``fxc::linear_w8_silu_mul`` /
    ``_add``, ``fxc::linear_w4_silu_mul`` / ``_add``, passes/fusion.py): the kept linear call and ATen for the
    product or the sum; all ATen off the CPU."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxcompiler import edf
    from fxcompiler.ops.linear import quantize_linear_weight_int8
    from fxcompiler.ops.quant_linear import quantize_linear_weight_int4

    ops = torch.ops.fxc
    w8 = quantize_linear_weight_int8(torch.randn(64, 16))
    w4 = quantize_linear_weight_int4(torch.randn(64, 16), 8)
    x, r = torch.randn(3, 16), torch.randn(3, 64)
    cases = [
        ("linear_w8", lambda x, q, s: ops.linear_w8_silu_mul.default(x, q, s, None, 64, -1), (x, *w8)),
        ("linear_w8", lambda x, q, s, r: ops.linear_w8_add.default(x, q, s, None, r, 64, -1), (x, *w8, r)),
        ("linear_w4", lambda x, q, s, m: ops.linear_w4.default(x, q, s, m, None, 64, 8), (x, *w4)),
        ("linear_w4", lambda x, q, s, m: ops.linear_w4_silu_mul.default(x, q, s, m, None, 64, 8), (x, *w4)),
        ("linear_w4", lambda x, q, s, m, r: ops.linear_w4_add.default(x, q, s, m, None, r, 64, 8), (x, *w4, r)),
    ]
    for linear, fn, args in cases:
        class M(torch.nn.Module):
            def forward(self, *a):
                return (fn(*a),)

        gm = make_fx(M())(*args)
        for n, v in zip((n for n in gm.graph.nodes if n.op == "placeholder"), args):
            n.meta["val"] = v
        kept = edf.aten_graph_module(gm, edf.extern_ops("cpu"))
        assert _fxc_calls(make_fx(kept)(*args)) == [linear]  # what export traces the package from
        aten_only = edf.aten_graph_module(gm)
        assert _fxc_calls(make_fx(aten_only)(*args)) == []
        assert torch.allclose(kept(*args)[0], gm(*args)[0], rtol=1e-5, atol=1e-5)
        assert torch.allclose(aten_only(*args)[0], gm(*args)[0], rtol=1e-5, atol=1e-5)


def test_package_key_ignores_symbol_names():
    """Graphs whose meta was re-derived (compile/build cache hits, artifacts) name their symbolic
    dims differently; the package key must not see it (else every warm start recompiles)."""
    from fxcompiler import edf
    from fxcompiler.graph_io import restore_meta

    class M(torch.nn.Module):
        def forward(self, x, table):
            return (torch.ops.fxc.rms_norm.default(x, x[0, 0], 1e-6), table + 1)

    keys = set()
    for a, b, c in (("s1", "s2", "s3"), ("s99", "s7", "s3"), ("s5", "s4", "s0")):
        gm = torch.fx.symbolic_trace(M())
        restore_meta(gm, {"placeholders": {"x": {"shape": [a, b, 8], "dtype": "float32"},
                                           "table": {"shape": [a, c], "dtype": "int64"}},
                          "hints": {a: 2, b: 3, c: 4}})
        keys.add(edf.package_key(gm))
    assert len(keys) == 1
    gm = torch.fx.symbolic_trace(M())  # sharing a dim differently is another graph
    restore_meta(gm, {"placeholders": {"x": {"shape": ["s1", "s2", 8], "dtype": "float32"},
                                       "table": {"shape": ["s2", "s3"], "dtype": "int64"}},
                      "hints": {"s1": 2, "s2": 3, "s3": 4}})
    assert edf.package_key(gm) not in keys


@pytest.mark.slow
def test_edf_second_conversion_hits_the_cache(built):
    from fxcompiler.edf import to_edf_pipelines

    llm, edf_pipes, cache_dir, _ = built
    stats: dict = {}
    again = to_edf_pipelines(llm.pipelines, cache_dir, stats=stats)
    assert stats.get("compiled", 0) == 0 and stats["cached"] == 3
    assert [sorted(p.blobs) for p in again] == [sorted(p.blobs) for p in edf_pipes]
    assert [b.graph for p in again for b in p.blobs.values()] == [b.graph for p in edf_pipes for b in p.blobs.values()]


def test_edf_without_a_cxx_compiler_raises_a_clear_error(monkeypatch, tmp_path):
    import torch._inductor.config as inductor_config

    from fxcompiler.edf import EdfCompileError, compile_package

    monkeypatch.delenv("CXX", raising=False)
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    # inductor_config.patch restores the option on exit (monkeypatch would not)
    with inductor_config.patch({"cpp.cxx": ("fxc-no-such-cxx",)}), \
            pytest.raises(EdfCompileError, match="need a C.. compiler"):
        compile_package(gm, tmp_path / "x.pt2")
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_llm_edf_generation_artifact_and_torch_mismatch(built, tmp_path, caplog):
    """LLM(comp_supertask_kind='edf') generates what fx generates; its artifact loads back (a
    different torch version in the manifest recompiles from the stored fx source, announced)."""
    import json
    import logging
    import shutil

    from fxcompiler import LLM, ManualBucketConfig, SamplingParams

    llm, _, cache_dir, _ = built
    model_dir = llm.test_model_path
    kw = {"max_seq_len_to_capture": 32, "bucket_config": ManualBucketConfig([(1, 16)], [(2, 32)]),
          "compiler_config_overrides": _forced_lowering()}  # the fixture's graphs
    prompts, sp = [[1, 5, 6, 7], [1, 9]], SamplingParams(max_tokens=8, temperature=0)
    fx = LLM(str(model_dir), cache_dir=None, **kw)
    expected = [o.outputs[0].token_ids for o in fx.generate(None, sp, prompt_token_ids=prompts)]
    edf = LLM(str(model_dir), cache_dir=cache_dir, comp_supertask_kind="edf", artifacts_export_path=tmp_path / "a",
              **kw)  # the packages of the module fixture are cache hits: nothing compiles
    edf_dir = Path(cache_dir) / "edf"  # (the program and its pipelines are cache hits too)
    assert len(list(edf_dir.glob("*.pt2"))) == 3
    assert sorted(edf_dir.glob("*")) == sorted([*edf_dir.glob("*.pt2"), *edf_dir.glob("*.pt2.sha256")])  # + checksums
    assert {b.kind for p in edf.pipelines for b in p.blobs.values()} == {"edf"}
    assert [o.outputs[0].token_ids for o in edf.generate(None, sp, prompt_token_ids=prompts)] == expected
    loaded = LLM.load_artifact(tmp_path / "a", cache_dir=cache_dir)
    assert [o.outputs[0].token_ids for o in loaded.generate(None, sp, prompt_token_ids=prompts)] == expected
    other = tmp_path / "b"
    shutil.copytree(tmp_path / "a", other)
    m = json.loads((other / "artifact.json").read_text())
    m["versions"]["torch"] = "0.0.1"
    (other / "artifact.json").write_text(json.dumps(m))
    with caplog.at_level(logging.WARNING, logger="fxcompiler.artifacts"):
        again = LLM.load_artifact(other, cache_dir=cache_dir)
    assert "recompiling edf package" in caplog.text
    assert [o.outputs[0].token_ids for o in again.generate(None, sp, prompt_token_ids=prompts)] == expected


@pytest.mark.slow
def test_llm_edf_num_compile_workers_compiles_in_parallel(built, tmp_path, caplog):
    """num_compile_workers=2: the 3 missing packages compile in 2 spawned worker processes (from
    the blobs' code and signatures), under the same keys as in-process compilation, and the
    LLM generates what fx generates."""
    import logging

    from fxcompiler import LLM, ManualBucketConfig, SamplingParams

    llm, _, serial_cache, _ = built
    kw = {"max_seq_len_to_capture": 32, "bucket_config": ManualBucketConfig([(1, 16)], [(2, 32)]),
          "compiler_config_overrides": _forced_lowering()}
    prompts, sp = [[1, 5, 6, 7], [1, 9]], SamplingParams(max_tokens=8, temperature=0)
    expected = [o.outputs[0].token_ids
                for o in LLM(str(llm.test_model_path), cache_dir=None, **kw).generate(None, sp, prompt_token_ids=prompts)]
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="fxcompiler.build"):
        edf = LLM(str(llm.test_model_path), cache_dir=cache, comp_supertask_kind="edf", num_compile_workers=2, **kw)
    stats = next(r.args for r in caplog.records if r.getMessage().startswith("edf: "))  # the logged dict
    assert stats["compiled"] == 3 and stats["workers"] == 2 and stats.get("cached", 0) == 0, stats
    packages = sorted(p.name for p in (cache / "edf").glob("*"))
    # the same packages and their checksums, no temporaries left
    assert packages == sorted(p.name for p in (Path(serial_cache) / "edf").glob("*"))
    assert len([p for p in packages if p.endswith(".pt2")]) == 3
    assert [o.outputs[0].token_ids for o in edf.generate(None, sp, prompt_token_ids=prompts)] == expected


def test_to_edf_pipelines_rejects_bad_num_workers():
    from fxcompiler.edf import to_edf_pipelines

    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="num_workers"):
            to_edf_pipelines([], None, num_workers=bad)


def test_a_killed_writers_temporary_package_is_removed_by_the_next_write(tmp_path):
    """Packages are written to ``.tmp-<pid>-...`` and renamed; one left by a writer that died mid-write is
    removed by the next write into the folder (the cache-size pruning never counts dot names)."""
    import hashlib
    import subprocess
    import sys

    from fxcompiler.edf import deserialize

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    folder = tmp_path / "edf"
    folder.mkdir()
    stale = folder / f".tmp-{gone}-0123abcd-{'0' * 64}.pt2"
    stale.write_bytes(b"half a package")
    data = b"package bytes"
    key = hashlib.sha256(b"key").hexdigest()
    package = deserialize(data, key, tmp_path)
    assert Path(package.path).read_bytes() == data and Path(package.path).name == f"{key}.pt2"
    assert not stale.exists()
    assert not [p for p in folder.iterdir() if p.name.startswith(".tmp-")]
