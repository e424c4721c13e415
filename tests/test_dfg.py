"""dfg supertasks: fx graph ⇄ ONNX ModelProto (checker-valid, exact round trip), networkx
analyses, dfg pipelines and the dfg backend."""
from __future__ import annotations

import functools
import itertools

import onnx
import pytest
import torch
from hypothesis import given, settings

from fxcompiler import dfg, testing
from fxcompiler.pipeline import Bucket, SuperTaskKind
from fxcompiler.pipeline_builder import build_pipelines, optimise

ARCH_CONFIGS = {  # in the space of testing.model_configs(), so property-test captures are shared
    "llama": testing.TinyConfig("llama", 2, 48, 3, 1, 97, 48),  # GQA 3:1, head_dim 16
    "qwen2": testing.TinyConfig("qwen2", 1, 32, 2, 2, 97, 48),
    "mistral": testing.TinyConfig("mistral", 2, 48, 6, 2, 97, 48),  # head_dim 8
    "gpt2": testing.TinyConfig("gpt2", 1, 32, 2, 2, 97, 48),
}
BUCKETS = [testing.TestBucket(2, 5, 0, 4), testing.TestBucket(3, 1, 17, 16), testing.TestBucket(1, 4, 9, 1)]


@functools.cache
def _optimised(cfg: testing.TinyConfig, options: tuple = ()):
    return optimise(testing.capture_tiny_model(cfg), dict(options))


def _assert_same_outputs(gm_a, gm_b, ctx, inputs):
    logits_a, caches_a = testing.run_program(gm_a, ctx, inputs)
    logits_b, caches_b = testing.run_program(gm_b, ctx, inputs)
    assert torch.equal(logits_a, logits_b)
    assert caches_a.keys() == caches_b.keys()
    for name in caches_a:
        assert torch.equal(caches_a[name], caches_b[name]), name


def _round_trip(gm, name="g"):
    model = dfg.fx_to_onnx(gm, name)
    onnx.checker.check_model(model)
    loaded = dfg.deserialize(dfg.serialize(model))
    return model, dfg.onnx_to_fx(loaded)


# ----------------------------------------------------------------------------- (a) round trip


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_optimised_graph_round_trip(arch):
    gm, ctx = _optimised(ARCH_CONFIGS[arch])
    model, back = _round_trip(gm, f"tiny_{arch}")
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert len(model.graph.node) == len(calls)
    assert [i.name for i in model.graph.input] == [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    domains = {o.domain for o in model.opset_import}
    assert {"", "aten", "fxc", dfg.BUILTIN_DOMAIN} <= domains
    assert {n.domain for n in model.graph.node} <= domains
    pa = next(n for n in model.graph.node if n.op_type == "qkv_paged_attention.default")
    assert pa.domain == "fxc"
    # Same nodes, names and targets: the same generated code.
    assert back.code == gm.code
    for bucket in BUCKETS:
        _assert_same_outputs(gm, back, ctx, testing.inputs_for_geometry(ctx.geometry, bucket))


def test_input_types_and_symbolic_dims():
    gm, _ = _optimised(ARCH_CONFIGS["llama"])
    model = dfg.fx_to_onnx(gm, "g")
    inputs = {vi.name: vi.type.tensor_type for vi in model.graph.input}
    ids = inputs["input_ids"]
    assert ids.elem_type == onnx.TensorProto.INT64
    assert all(d.dim_param for d in ids.shape.dim)  # batch, tokens: symbolic
    cache = inputs["k_caches_0"]
    assert cache.elem_type == onnx.TensorProto.DOUBLE
    assert [d.dim_value for d in cache.shape.dim][1:] == [16, 1, 16]
    assert cache.shape.dim[0].dim_param
    # restore_meta gives every node its fake value back (as graph_io.restore_meta does)
    back = dfg.onnx_to_fx(model, restore_meta=True)
    vals = {n.name: n.meta.get("val") for n in back.graph.nodes if n.op != "output"}
    assert all(v is not None for v in vals.values())
    orig = {n.name: n.meta["val"] for n in gm.graph.nodes if n.op == "call_function"}
    for name, val in orig.items():
        if isinstance(val, torch.Tensor):
            assert vals[name].dtype == val.dtype and vals[name].dim() == val.dim(), name


@pytest.mark.parametrize("options", [(("embed_all_constants_into_graph", True),),
                                     (("embed_all_constants_into_graph", True), ("auto_bfloat16_cast", True))],
                         ids=["f64", "bf16"])
def test_embedded_constants_round_trip(options):
    gm, ctx = _optimised(ARCH_CONFIGS["llama"], options)
    consts = [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert consts, "embed_all_constants_into_graph left no constants in the graph"
    model, back = _round_trip(gm)
    assert len(model.graph.initializer) == len(consts)
    assert back.code == gm.code
    for n in consts:
        a, b = getattr(gm, n.target), getattr(back, n.target)
        assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)
    for bucket in BUCKETS[:2]:
        _assert_same_outputs(gm, back, ctx, testing.inputs_for_geometry(ctx.geometry, bucket))


def test_argument_encoding_round_trips_exactly():
    def f(x, y):
        a = torch.ops.aten.add.Tensor(x, 1e-06)
        b = torch.ops.aten._to_copy.default(a, dtype=torch.float32, memory_format=torch.contiguous_format,
                                            device=torch.device("cpu"), layout=torch.strided)
        c = torch.ops.aten.clamp.default(b, float("-inf"), -0.0)
        d = torch.ops.aten.cat.default([c, c, y.float()], -1)
        e = torch.ops.aten.split.Tensor(d, 2, 1)
        return e[0], torch.ops.aten.mul.Tensor(e[1], True), None

    gm = torch.fx.symbolic_trace(f)
    model, back = _round_trip(gm, "f")
    assert back.code == gm.code
    kinds = {(n.domain, n.op_type) for n in model.graph.node}
    assert (dfg.BUILTIN_DOMAIN, "getitem") in kinds and (dfg.METHOD_DOMAIN, "float") in kinds
    # no meta['val']: inputs and outputs have an opaque "unknown" type
    assert model.graph.input[0].type.opaque_type.name == "unknown"
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 2)
    for a, b in zip(gm(x, y), back(x, y)):
        assert (a is None and b is None) or torch.equal(a, b)


def test_rejects_unconvertible_graph():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
    with pytest.raises(ValueError, match="call_module"):
        dfg.fx_to_onnx(gm, "m")


# ----------------------------------------------------------------------------- (b) networkx


def test_networkx_view_liveness_and_critical_path():
    import networkx as nx

    gm, ctx = _optimised(ARCH_CONFIGS["llama"])
    model = dfg.fx_to_onnx(gm, "g")
    G = dfg.dfg_graph(model)
    assert G.number_of_nodes() == len(model.graph.node)
    assert nx.is_directed_acyclic_graph(G)
    assert G.nodes["qkv_paged_attention_default"]["domain"] == "fxc"
    produced = {o for n in model.graph.node for o in n.output}
    expected_edges = {(p, n.name) for n in model.graph.node for i in n.input if i in produced
                      for p in [i]}
    assert set(G.edges) == expected_edges
    path = dfg.critical_path(model)
    assert 10 < len(path) < len(model.graph.node)
    assert all(G.has_edge(a, b) for a, b in itertools.pairwise(path))
    assert path[-1] == model.graph.output[0].name

    live = dfg.liveness(model)
    assert 1 < live["max_live"] < live["num_intermediates"]
    assert live["max_live_bytes"] is None  # symbolic dims unbound
    inputs = testing.inputs_for_geometry(ctx.geometry, BUCKETS[0])
    targets = {s.name: s.target for s in ctx.input_specs if s.kind == "user"}
    sizes = dfg.input_sizes(model, {name: inputs[t] for name, t in targets.items()})
    live = dfg.liveness(model, sizes)
    assert live["max_live_bytes"] is not None
    B, T = BUCKETS[0].batch, BUCKETS[0].tokens
    hidden = ARCH_CONFIGS["llama"].hidden
    assert live["max_live_bytes"] >= B * T * hidden * 8  # at least one f64 hidden state
    assert live["max_live_bytes"] < 100 * B * T * 3 * hidden * 8


def test_liveness_small_graph_exact():
    def f(x):
        a = torch.ops.aten.add.Tensor(x, 1)
        b = torch.ops.aten.mul.Tensor(a, 2)
        c = torch.ops.aten.add.Tensor(a, b)
        d = torch.ops.aten.neg.default(x)  # dead-ish: read by nobody but the output
        return c, d

    gm = torch.fx.symbolic_trace(f)
    model = dfg.fx_to_onnx(gm, "f")
    a, b, c, _d = (n.name for n in gm.graph.nodes if n.op == "call_function")
    assert dfg.critical_path(model) == [a, b, c]
    live = dfg.liveness(model)
    assert live["num_intermediates"] == 4
    assert live["max_live"] == 3 and live["peak_node"] == c  # a, b, c; then c, d
    assert live["max_live_bytes"] is None


# ----------------------------------------------------------------------------- (c) property


# 1-layer configs (a subset of the default space, so captures are shared with other property
# tests): 50 examples draw ~14 distinct configs instead of ~20, which keeps this file under a
# minute; depth and the optimised graphs are covered by the tests above.
@settings(max_examples=50, deadline=None)
@given(testing.model_configs(max_layers=1), testing.buckets())
def test_round_trip_preserves_outputs(cfg, bucket):
    program = testing.capture_tiny_model(cfg)
    ctx = testing.context_of(program)
    gm = program.graph_module
    _, back = _round_trip(gm)
    assert back.code == gm.code
    _assert_same_outputs(gm, back, ctx, testing.example_inputs(program, bucket))


# ----------------------------------------------------------------------------- pipelines + backend


def test_single_supertask_pipeline_and_backend():
    from backends import get_backend

    gm, ctx = _optimised(ARCH_CONFIGS["qwen2"])
    program = testing.capture_tiny_model(ARCH_CONFIGS["qwen2"])
    built = build_pipelines(program, [Bucket.prefill(2, 16), Bucket.decode(3, 32)], "tiny",
                            options={"use_blockwise_compile": False}, optimised=(gm, ctx))
    dfg_pipes = dfg.to_dfg_pipelines(built.pipelines)
    assert len({b for p in dfg_pipes for b in p.blobs}) == 1
    for fx_pipe, dfg_pipe in zip(built.pipelines, dfg_pipes):
        _check_backend(fx_pipe, dfg_pipe, ctx.params, ctx.geometry, get_backend)


def _check_backend(fx_pipe, dfg_pipe, params, geometry, get_backend):
    fx_exe = get_backend("fx", "cpu")(fx_pipe, params, torch.device("cpu"))
    dfg_exe = get_backend("dfg", "cpu")(dfg_pipe, params, torch.device("cpu"))
    b = fx_pipe.bucket
    tb = testing.TestBucket(b.batch_size, b.input_ids_size, b.kv_cache_size, fx_pipe.metadata["block_size"])
    inputs = testing.inputs_for_geometry(geometry, tb)
    targets = fx_pipe.metadata["inputs"]
    assert dfg_exe.user_inputs == fx_exe.user_inputs
    args_fx = [inputs[targets[n]].clone() for n in fx_exe.user_inputs]
    args_dfg = [inputs[targets[n]].clone() for n in dfg_exe.user_inputs]
    with torch.inference_mode():
        out_fx, out_dfg = fx_exe(*args_fx), dfg_exe(*args_dfg)
    assert torch.equal(out_fx, out_dfg)
    for a, c in zip(args_fx, args_dfg):  # KV caches written alike
        assert torch.equal(a, c)


def test_llm_pipelines_as_dfg(tmp_path):
    from backends import get_backend
    from fxcompiler import LLM
    from fxcompiler.pipeline import pipeline_from_dict
    from tests.conftest import save_tiny_model

    path = save_tiny_model(tmp_path / "llama", "llama")
    llm = LLM(str(path), max_seq_len_to_capture=64, cache_dir=None, skip_engine=True)
    pipes = llm.pipelines
    dfg_pipes = dfg.to_dfg_pipelines(pipes)
    fx_blobs = {b for p in pipes for b in p.blobs}
    dfg_blobs = {b: blob for p in dfg_pipes for b, blob in p.blobs.items()}
    assert len(dfg_blobs) == len(fx_blobs)  # shared blocks stay shared, buckets share blobs
    for bid, blob in dfg_blobs.items():
        assert blob.kind == "dfg" and isinstance(blob.graph, onnx.ModelProto)
        onnx.checker.check_model(blob.graph)
        assert dfg.blob_id(dfg.deserialize(dfg.serialize(blob.graph))) == bid
    for p, d in zip(pipes, dfg_pipes):
        assert [t.kind for t in d.supertasks.values()] == [
            SuperTaskKind.DFG if t.kind is SuperTaskKind.FX else t.kind for t in p.supertasks.values()]
        assert [(t.inputs, t.outputs) for t in d.supertasks.values()] == [
            (t.inputs, t.outputs) for t in p.supertasks.values()]
        assert all(t.kind is SuperTaskKind.DFG for _, t in d.compute_supertasks())
        assert all(t.kind is SuperTaskKind.FX for _, t in p.compute_supertasks())  # the fx pipeline is untouched
        again = pipeline_from_dict(d.to_dict(), {b: blob.graph for b, blob in d.blobs.items()})
        assert again.to_json() == d.to_json()
    chosen = [pipes[0], pipes[len(pipes) // 2], pipes[-1]]
    assert any(p.bucket.is_decode for p in chosen) and any(p.bucket.is_prefill for p in chosen)
    for p in chosen:
        _check_backend(p, dfg_pipes[pipes.index(p)], llm._build.params, llm.geometry, get_backend)
    with pytest.raises(NotImplementedError, match="dfg compute supertasks"):
        get_backend("dfg", "cpu")(pipes[0], llm._build.params, torch.device("cpu"))
