"""``fuse_linear_silu_mul`` / ``fuse_linear_add`` (passes/fusion.py) on W8, W4 and W4A8 linears: the fused ops
emitted on a tiny model, the same tokens as without the passes. (The ops themselves:
``tests/backends/cpu/test_epilogue_kernels.py``, the W4A8 forms in ``tests/test_w4a8.py``.)"""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("scheme", ["W8A16", "W8A32", "W4A16", "W4A32", "W4A8"])
def test_fuse_linear_passes_keep_the_tokens(tiny_models, scheme):
    """W8 and W4 weights (g32) with bf16 (A16) or fp32 (A32) activations, and W4A8: the default pipeline fuses each
    layer's gate/up linear with silu_mul and its o_proj / down_proj with the residual adds; with the passes disabled the graph
    keeps the separate ops, and both engines generate the same tokens."""
    from fxcompiler import LLM, LLMConfig, SamplingParams
    from fxcompiler.quant_config import QuantizationConfig

    config = QuantizationConfig.from_str(scheme)

    def build(**kw):
        return LLM(str(tiny_models["llama"]), max_seq_len_to_capture=64, cache_dir=None, quantization_group_size=32,
                   llm_config=LLMConfig(quantization_config=config), **kw)

    fused = build()
    plain = build(compiler_config_overrides={"passes": {"disable": ["fuse_linear_silu_mul", "fuse_linear_add"]}})
    try:
        fired = {h["pass"]: h["fused"] for h in fused.pass_history if h["pass"].startswith("fuse_linear_")}
        op = {"W8": "linear_w8", "W4": "linear_w4a8" if scheme == "W4A8" else "linear_w4"}[scheme[:2]]
        targets = {str(n.target) for p in fused.pipelines for b in p.blobs.values() for n in b.graph.graph.nodes}
        assert {f"fxc.{op}_silu_mul.default", f"fxc.{op}_add.default"} <= targets, sorted(targets)
        assert fired == {"fuse_linear_silu_mul": 2, "fuse_linear_add": 4}  # two layers: gate/up; o_proj, down_proj
        assert not any(h["pass"].startswith("fuse_linear_") for h in plain.pass_history)
        sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        prompts = [[5, 17, 33, 2], [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
        assert [o.outputs[0].token_ids for o in fused.generate(None, sp, prompt_token_ids=prompts)] == \
            [o.outputs[0].token_ids for o in plain.generate(None, sp, prompt_token_ids=prompts)]
    finally:
        fused.shutdown()
        plain.shutdown()


# -- the float32 / bfloat16 linears of lower_cpu_kernels (fxc::linear, fxc::linear_by_m) --------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("choice", ["fxc", "by_m"])
def test_fuse_linear_add_takes_the_lowered_float_linears_bit_for_bit(dtype, choice):
    """After ``lower_cpu_kernels`` (canned timings: fxc::linear for every M, or only up to M = 4, which makes
    fxc::linear_by_m), each layer's o_proj and down_proj with their residual adds become fxc::linear_add /
    fxc::linear_by_m_add, and the logits and KV caches are bit-identical, decode and prefill buckets alike
    (by_m: M = 3 takes the kernel with its fused add, M = 10 the ATen op and one add)."""
    import torch

    import backends.cpu as fxc_cpu
    from fxcompiler import testing
    from fxcompiler.pass_manager import get_pass

    from .test_lower_cpu_kernels import CFG, FakeTuner, _before, _run

    fxc_cpu.kernels_available()
    speedup = (lambda k, n, dt, m: 2.0) if choice == "fxc" else (lambda k, n, dt, m: 1.6 if m == 1 else 0.6)
    lower = get_pass("lower_cpu_kernels", tuner=FakeTuner(speedup), max_dual_fraction=1.0)
    program = testing.capture_tiny_model(CFG, dtype=getattr(torch, dtype))
    fuse = get_pass("fuse_linear_add")
    for bucket in (testing.TestBucket(1, 3, 4, 4), testing.TestBucket(2, 5, 3, 4)):
        info = testing.assert_pass_preserves_semantics(fuse, program, testing.example_inputs(program, bucket),
                                                       rtol=0, atol=0, passes_before=(*_before(), lower))
        assert info == {"fused": 2 * CFG.layers}
    gm, _, _ = _run(program, *_before(), lower, fuse)
    fused = {"fxc": torch.ops.fxc.linear_add.default, "by_m": torch.ops.fxc.linear_by_m_add.default}[choice]
    assert sum(n.target is fused for n in gm.graph.nodes) == 2 * CFG.layers
    assert not any(n.target is torch.ops.aten.add.Tensor and any(
        a.target in (torch.ops.fxc.linear.default, torch.ops.fxc.linear_by_m.default)
        for a in n.args if isinstance(a, torch.fx.Node)) for n in gm.graph.nodes)


def test_fuse_linear_add_leaves_a_linear_with_other_users_or_another_dtype():
    """The add must be the linear's only user and match its shape and dtype (else the two ops stay)."""
    import operator

    import torch
    from torch.fx import Graph, GraphModule

    from fxcompiler.ops.linear import pack_linear_weight
    from fxcompiler.pass_manager import CompileContext, get_pass

    def graph(second_user: bool, residual_dtype):
        g = Graph()
        x, r, w = g.placeholder("x"), g.placeholder("r"), g.placeholder("w")
        x.meta["val"], r.meta["val"] = torch.empty(2, 8), torch.empty(2, 16, dtype=residual_dtype)
        w.meta["val"] = pack_linear_weight(torch.randn(16, 8))
        lin = g.call_function(torch.ops.fxc.linear.default, (x, w, None, 16))
        lin.meta["val"] = torch.empty(2, 16)
        add = g.call_function(torch.ops.aten.add.Tensor, (r, lin))
        add.meta["val"] = torch.empty(2, 16)
        outs = [add]
        if second_user:
            outs.append(g.call_function(operator.neg, (lin,)))
            outs[-1].meta["val"] = torch.empty(2, 16)
        g.output(tuple(outs))
        return GraphModule(torch.nn.Module(), g)

    fuse = get_pass("fuse_linear_add")
    for second_user, residual_dtype, fused in ((True, torch.float32, 0), (False, torch.bfloat16, 0),
                                               (False, torch.float32, 1)):
        result = fuse(graph(second_user, residual_dtype), CompileContext([], {}, None))
        assert result.info == {"fused": fused} and result.modified is bool(fused)
        targets = [n.target for n in result.graph_module.graph.nodes if n.op == "call_function"]
        assert (torch.ops.fxc.linear_add.default in targets) is bool(fused)
