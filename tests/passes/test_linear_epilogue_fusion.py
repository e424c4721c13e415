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
