"""Every built-in pass computes the same logits and KV caches as its input graph (fp64),
over hypothesis-generated tiny configs of four architectures and input shapes."""
from __future__ import annotations

from collections import Counter

import torch
from hypothesis import HealthCheck, given, settings

from fxcompiler import testing
from fxcompiler.pass_manager import DEFAULT_PASSES, get_pass

PIPELINE = [name for name in DEFAULT_PASSES]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=testing.model_configs(), bucket=testing.buckets())
def test_each_default_pass_preserves_semantics(cfg, bucket):
    """The default pipeline, pass by pass: each pass's output graph against its input graph
    (one chain per example, so the cost is linear in the number of passes)."""
    program = testing.capture_tiny_model(cfg)
    inputs = testing.example_inputs(program, bucket)
    ctx = testing.context_of(program)
    gm = program.graph_module
    before = testing.run_program(gm, ctx, inputs)
    for name in PIPELINE:
        gm = get_pass(name)(gm, ctx).graph_module
        gm.recompile()
        gm.graph.lint()
        after = testing.run_program(gm, ctx, inputs)
        torch.testing.assert_close(after[0], before[0], rtol=1e-9, atol=1e-9,
                                   msg=lambda m, name=name: f"pass {name!r} changed the logits: {m}")
        for cache in before[1]:
            torch.testing.assert_close(after[1][cache], before[1][cache], rtol=1e-9, atol=1e-9,
                                       msg=lambda m, name=name, cache=cache: f"pass {name!r} changed {cache}: {m}")
        before = after


def _ops(gm) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _run(names, program):
    ctx = testing.context_of(program)
    gm = program.graph_module
    infos = []
    for n in names:
        r = get_pass(n)(gm, ctx)
        gm = r.graph_module
        gm.recompile()
        infos.append(r.info)
    return gm, ctx, infos


CFG = testing.TinyConfig("llama", layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, intermediate=48)


def test_strip_asserts_and_fold_casts_remove_nodes():
    program = testing.capture_tiny_model(CFG, dtype=torch.float32)
    before = _ops(program.graph_module)
    gm, _, (strip, fold) = _run(["strip_asserts", "fold_casts"], program)
    after = _ops(gm)
    assert strip["removed"] == before["aten._assert_tensor_metadata.default"] > 0
    assert after["aten._assert_tensor_metadata.default"] == 0
    assert fold["folded"] > 0 and sum(after.values()) == sum(before.values()) - strip["removed"] - fold["folded"]


def test_weight_layout_and_fuse_projections_rewrite_linears():
    program = testing.capture_tiny_model(CFG)
    n_linear = _ops(program.graph_module)["aten.linear.default"]
    assert n_linear == 2 * 7 + 1
    gm, ctx, (layout, fuse) = _run(["weight_layout", "fuse_projections"], program)
    ops = _ops(gm)
    assert layout["rewritten"] == n_linear and ops["aten.linear.default"] == 0
    assert fuse["fused_groups"] == 2 * 2  # q/k/v and gate/up in each layer
    assert ops["aten.matmul.default"] == n_linear - 2 * (2 + 1)
    fused = [t for t in ctx.params if "+" in t]
    assert len(fused) == 4 and all(ctx.params[t].shape[0] == CFG.hidden for t in fused)
    assert not any(t.endswith("q_proj.weight") for t in ctx.params)  # originals released


def test_dce_drops_dead_nodes_and_unused_params():
    program = testing.capture_tiny_model(CFG)
    gm = program.graph_module
    x = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.embedding.default)
    with gm.graph.inserting_after(x):
        gm.graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))  # dead
    gm.recompile()
    _, _, (info,) = _run(["dce"], program)
    assert info["removed_nodes"] >= 1


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=testing.model_configs(archs=("llama", "qwen2", "mistral")), bucket=testing.buckets())
def test_elementwise_fusions_fp32(cfg, bucket):
    """fp32 graphs: RMSNorm (no casts: 2 per layer + the final norm), SiLU·mul and RoPE fuse."""
    program = testing.capture_tiny_model(cfg, dtype=torch.float32)
    inputs = testing.example_inputs(program, bucket)
    before = ("strip_asserts", "fold_casts", "dce")
    info = testing.assert_pass_preserves_semantics(get_pass("fuse_rms_norm"), program, inputs, rtol=2e-5, atol=2e-5,
                                                   passes_before=tuple(get_pass(n) for n in before))
    assert info["fused"] == 2 * cfg.layers + 1
    info = testing.assert_pass_preserves_semantics(get_pass("fuse_silu_mul"), program, inputs, rtol=2e-5, atol=2e-5)
    assert info["fused"] == cfg.layers
    info = testing.assert_pass_preserves_semantics(get_pass("fuse_rope"), program, inputs, rtol=0, atol=0)
    assert info["fused"] == 2 * cfg.layers  # q and k of every layer, bit-identical


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=testing.model_configs(), bucket=testing.buckets())
def test_qkv_attention_fusion_fp32(cfg, bucket):
    """After the default passes before it, every layer's split/view/permute/rope/attention/view chain becomes one
    fxc::qkv_paged_attention with bit-identical logits and caches (qwen2's separate q/k/v bias adds become one
    add of the concatenated biases on the projection)."""
    program = testing.capture_tiny_model(cfg, dtype=torch.float32)
    inputs = testing.example_inputs(program, bucket)
    at = PIPELINE.index("fuse_qkv_attention")
    info = testing.assert_pass_preserves_semantics(get_pass("fuse_qkv_attention"), program, inputs, rtol=0, atol=0,
                                                   passes_before=tuple(get_pass(n) for n in PIPELINE[:at]))
    assert info["fused"] == cfg.layers
    gm, ctx = testing._run_passes_before(program, tuple(get_pass(n) for n in PIPELINE[:at + 2]))
    ops = _ops(gm)
    assert ops["fxc.qkv_paged_attention.default"] == cfg.layers
    assert not ops["fxc.paged_attention.default"] and not ops["fxc.rope.default"]
    assert not ops["aten.permute.default"]
    # the only splits left are the gate/up ones of the gated MLPs (gpt2 has none)
    assert ops["aten.split_with_sizes.default"] == (0 if cfg.arch == "gpt2" else cfg.layers)
    if cfg.arch == "qwen2":  # one bias add a layer, on the fused projection; the separate biases are gone
        assert ops["aten.add.Tensor"] == _ops(testing._run_passes_before(program, tuple(
            get_pass(n) for n in PIPELINE[:at]))[0])["aten.add.Tensor"] - 2 * cfg.layers
        separate = [n for n in ctx.params if "+" not in n and n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
        assert not separate and sum("q_proj.bias+" in n for n in ctx.params) == cfg.layers
