"""``decompose``: the graph after it computes the same logits and KV caches (fp64), keeps its
placeholders and ``fxc::*`` nodes, and the default pipeline after ``model_rewrite=True``
still produces pre-transposed matmuls and fused projections."""
from __future__ import annotations

from collections import Counter

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxcompiler import testing
from fxcompiler.pass_manager import (
    DEFAULT_PASSES,
    CompileContext,
    FunctionPass,
    PassResult,
    get_pass,
)
from passes.decompose import DEFAULT_TABLE, MODEL_REWRITE_TABLE, OPTION

aten = torch.ops.aten


def _pipeline(*names, first=None):
    """One pass that runs ``first`` and then the named passes (to check a whole pipeline)."""
    def run(gm, ctx):
        infos = []
        for p in ([first] if first is not None else []) + [get_pass(n) for n in names]:
            r = p(gm, ctx)
            gm = r.graph_module
            gm.recompile()
            infos.append((p.name, r.info))
        return PassResult(gm, True, {"passes": infos})

    return FunctionPass(run, "pipeline")


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=testing.model_configs(max_layers=2), bucket=testing.buckets(), pipeline=st.booleans())
def test_decompose_preserves_semantics(cfg, bucket, pipeline):
    """Every case checks the default table; half of them then ``model_rewrite=True`` alone, the
    other half ``model_rewrite=True`` followed by the whole default pipeline (one capture each)."""
    program = testing.capture_tiny_model(cfg)
    inputs = testing.example_inputs(program, bucket)
    info = testing.assert_pass_preserves_semantics(get_pass("decompose"), program, inputs)
    assert info["skipped"] == 0 and info["decomposed"] > 0 and not info["model_rewrite"]
    rewrite = get_pass("decompose", model_rewrite=True)
    if pipeline:
        testing.assert_pass_preserves_semantics(_pipeline(*DEFAULT_PASSES, first=rewrite), program, inputs)
    else:
        info = testing.assert_pass_preserves_semantics(rewrite, program, inputs)
        assert info["skipped"] == 0 and info["by_op"]["aten.linear.default"] >= 1


def _ops(gm) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _run(program, passes, options=None):
    ctx = testing.context_of(program)
    ctx.options.update(options or {})
    gm = program.graph_module
    infos = {}
    for p in passes:
        p = get_pass(p) if isinstance(p, str) else p
        r = p(gm, ctx)
        gm = r.graph_module
        gm.recompile()
        infos[p.name] = r.info
    return gm, ctx, infos


LLAMA = testing.TinyConfig("llama", layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, intermediate=48)
QWEN2 = testing.TinyConfig("qwen2", layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, intermediate=48)
GPT2 = testing.TinyConfig("gpt2", layers=2, hidden=32, heads=4, kv_heads=4, vocab=64, intermediate=48)


def test_default_table_rewrites_composites_and_keeps_linear():
    program = testing.capture_tiny_model(GPT2)
    before = _ops(program.graph_module)
    gm, _, infos = _run(program, [get_pass("decompose")])
    after = _ops(gm)
    assert not any(str(op) in after for op in DEFAULT_TABLE)
    assert after["aten.native_layer_norm.default"] == before["aten.layer_norm.default"] == 2 * 2 + 1
    assert after["aten.permute.default"] == before["aten.transpose.int"] > 0
    assert after["aten.split_with_sizes.default"] == before["aten.split.Tensor"] == 2
    assert before["aten.dropout.default"] > 0 and after["aten.dropout.default"] == 0
    assert after["aten.linear.default"] == before["aten.linear.default"] == 1  # lm_head, kept
    assert after["fxc.paged_attention.default"] == before["fxc.paged_attention.default"] == 2
    assert infos["decompose"]["decomposed"] == sum(before[str(op)] for op in DEFAULT_TABLE)


def test_placeholders_and_attention_untouched():
    program = testing.capture_tiny_model(LLAMA)
    names = [n.name for n in program.graph_module.graph.nodes if n.op == "placeholder"]
    attn = [(n.name, [str(a) for a in n.args]) for n in program.graph_module.graph.nodes
            if n.target is torch.ops.fxc.paged_attention.default]
    gm, ctx, _ = _run(program, [get_pass("decompose", model_rewrite=True)])
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == names == [s.name for s in ctx.input_specs]
    attn_after = [(n, a) for n, a in ((n.name, [str(a) for a in n.args]) for n in gm.graph.nodes
                                      if n.target is torch.ops.fxc.paged_attention.default)]
    assert [a[0] for a in attn_after] == [a[0] for a in attn]
    # the cache operands are still the very placeholders (in-place writes reach the caller's tensors)
    for (_, args_before), (_, args_after) in zip(attn, attn_after):
        assert args_after[3:9] == args_before[3:9]
    for n in gm.graph.nodes:  # every node keeps a (symbolic) fake value
        if n.op == "call_function" and n.target is not torch.ops.aten._assert_tensor_metadata.default:
            assert "val" in n.meta, n.format_node()
    sym = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.view.default
           and any(isinstance(d, torch.SymInt) for d in n.meta["val"].shape)]
    assert sym  # dynamic shapes stay dynamic


def test_model_rewrite_decomposes_linear_norms():
    program = testing.capture_tiny_model(GPT2)
    gm, _, _ = _run(program, [get_pass("decompose", model_rewrite=True)])
    ops = _ops(gm)
    for op in ("aten.linear.default", "aten.layer_norm.default", "aten.native_layer_norm.default"):
        assert ops[op] == 0, op
    assert ops["aten.var_mean.correction"] == 2 * 2 + 1 and ops["aten.rsqrt.default"] >= 5
    assert ops["aten.mm.default"] == 1  # lm_head (GPT-2's projections are Conv1D addmm already)


def test_model_rewrite_from_compile_options_and_fxc_rms_norm():
    program = testing.capture_tiny_model(LLAMA, dtype=torch.float32)
    gm, _, infos = _run(program, ["strip_asserts", "fold_casts", "dce", "fuse_rms_norm", get_pass("decompose")],
                        options={OPTION: True})
    assert infos["fuse_rms_norm"]["fused"] == 2 * 2 + 1
    by_op = infos["decompose"]["by_op"]
    assert by_op["fxc.rms_norm.default"] == 5 and by_op["aten.linear.default"] == 7 * 2 + 1
    ops = _ops(gm)
    assert ops["fxc.rms_norm.default"] == 0 and ops["aten.linear.default"] == 0
    assert ops["aten.rsqrt.default"] == 5


def _linear_weights_ok(gm, ctx):
    """Every matmul/mm on a parameter reads a [K, N] weight directly (no transpose node)."""
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (aten.mm.default, aten.matmul.default):
            w = node.args[1]
            assert w.op == "placeholder" and ctx.param_of(w) is not None, node.format_node()
            n += 1
    return n


def test_model_rewrite_then_default_pipeline_is_the_fast_graph():
    for cfg, bias_adds in ((LLAMA, 0), (QWEN2, 3)):
        base_gm, base_ctx, base = _run(testing.capture_tiny_model(cfg), list(DEFAULT_PASSES))
        gm, ctx, infos = _run(testing.capture_tiny_model(cfg),
                              [get_pass("decompose", model_rewrite=True), *DEFAULT_PASSES])
        ops, base_ops = _ops(gm), _ops(base_gm)
        assert infos["weight_layout"]["decomposed_linears"] == infos["weight_layout"]["rewritten"] == 7 * 2 + 1
        assert infos["fuse_projections"]["fused_groups"] == base["fuse_projections"]["fused_groups"] == 2 * 2
        assert _linear_weights_ok(gm, ctx) == _linear_weights_ok(base_gm, base_ctx) == 7 * 2 + 1 - 2 * (2 + 1)
        assert ops["aten.mm.default"] == base_ops["aten.matmul.default"] and ops["aten.linear.default"] == 0
        assert ops["aten.addmm.default"] == 0 and ops["aten.t.default"] == 0
        assert ops["aten.permute.default"] == base_ops["aten.permute.default"] + base_ops["aten.transpose.int"]  # heads only
        assert ops["aten.add.Tensor"] == base_ops["aten.add.Tensor"]  # biases: one add per projection
        assert sorted(ctx.params) == sorted(base_ctx.params)  # same fused/transposed weights
        for name, w in ctx.params.items():
            torch.testing.assert_close(w, base_ctx.params[name], rtol=0, atol=0)
        del bias_adds


def test_guarding_decomposition_is_skipped():
    """A table entry that branches on a symbolic size would specialise the graph: the node stays."""
    def embedding_guarding(weight, ids, *rest):
        if ids.shape[1] > 5:  # a guard on the dynamic token count
            return aten.embedding.default(weight, ids)
        return aten.embedding.default(weight, ids) * 1.0

    program = testing.capture_tiny_model(LLAMA)
    p = get_pass("decompose", table={aten.embedding.default: embedding_guarding})
    gm, _, infos = _run(program, [p])
    assert infos["decompose"]["skipped"] == 1 and infos["decompose"]["decomposed"] == 0
    assert _ops(gm)["aten.embedding.default"] == 1


def test_mutating_ops_are_never_decomposed():
    program = testing.capture_tiny_model(LLAMA)
    p = get_pass("decompose", table={torch.ops.fxc.paged_attention.default: lambda *a: None})
    assert torch.ops.fxc.paged_attention.default not in p.table_for(CompileContext([], {}, None))
    assert set(MODEL_REWRITE_TABLE) & set(DEFAULT_TABLE) == set()
    _, _, infos = _run(program, [p])
    assert infos["decompose"]["decomposed"] == 0


def test_model_rewrite_lm_head_still_sliced_when_logits_slice_follows_weight_layout():
    """``logits_slice`` moves the row selection through projections on a parameter weight; a
    decomposed lm_head reads ``permute(W)`` until ``weight_layout`` has run, so the pass must
    come after it for ``model_rewrite`` graphs to compute logits of the sampled rows only."""
    order = [n for n in DEFAULT_PASSES if n != "logits_slice"]
    order.insert(order.index("weight_layout") + 1, "logits_slice")
    program = testing.capture_tiny_model(LLAMA)
    gm, _, infos = _run(program, [get_pass("decompose", model_rewrite=True), *order])
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    assert out.target is aten.mm.default and infos["logits_slice"]["moved"] >= 1
    assert _ops(gm)["aten.index_select.default"] == 1


def test_specialisations_left_in_the_shape_env_do_not_leak_into_decompositions():
    """Copies of a capture share its fake tensors and ShapeEnv, and a pass that compares symbolic
    sizes with numbers (``shape == other.shape``) can specialise a dim there for good. The
    decompositions are traced in a fresh environment, so they stay generic in every dim."""
    from torch._guards import detect_fake_mode

    program = testing.capture_tiny_model(testing.TinyConfig("qwen2", 1, 24, 3, 1, 64, 32))
    ids = next(n for n in program.graph_module.graph.nodes if n.name == "input_ids")
    env = detect_fake_mode([ids.meta["val"]]).shape_env
    tokens = ids.meta["val"].shape[1]
    assert bool(tokens == 3)  # what a careless pass does: the env now says tokens == 3 (the export example)
    assert env.replacements  # specialised
    for bucket in (testing.TestBucket(2, 1, 5, 4), testing.TestBucket(1, 7, 0, 16)):
        inputs = testing.example_inputs(program, bucket)
        info = testing.assert_pass_preserves_semantics(get_pass("decompose", model_rewrite=True), program, inputs)
        assert info["skipped"] == 0
