"""End to end: SmolLM2-135M-Instruct with ``lower_cpu_kernels`` inserted after ``fuse_projections``.

fp32, every parameter matmul forced onto ``fxc::linear``: greedy tokens equal transformers'
(divergence allowed only at a near-tie of transformers' top-2 logits, the rule of
tests/test_smollm2.py). bf16 with the tuner deciding is covered by tests/test_bf16_accuracy.py
(the default pipeline) and the bf16 property tests of tests/passes/test_lower_cpu_kernels.py.
"""
from __future__ import annotations

import pytest
import torch

from fxcompiler import LLM, SamplingParams
from fxcompiler.models.loader import model_directory
from fxcompiler.models.sources import DEFAULT_MODEL_ID, resolve_model_source
from fxcompiler.pass_manager import get_pass

from .test_smollm2 import PROMPTS, _check_against_hf

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
SP = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _insert(p):
    return {"passes": {"insert": [(p, {"after": "fuse_projections"})]}}


def _generate(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)]


def _lowering(llm) -> dict:
    return next(h for h in llm._build.context.history if h["pass"] == "lower_cpu_kernels")


def _param_bytes(llm) -> int:
    return sum(t.numel() * t.element_size() for t in llm._build.params.values())


def test_fp32_lowered_greedy_matches_transformers():
    llm = LLM(DEFAULT_MODEL_ID, compiler_config_overrides=_insert(get_pass("lower_cpu_kernels", force=True)))
    info = _lowering(llm)
    assert info["isa"] != "aten" and info["lowered"] > 0, f"fxc kernels unavailable here: {info}"
    lowered = sum(h["lowered"] for h in llm._build.context.history if h["pass"] == "lower_cpu_kernels")
    assert lowered == 4 * 30 + 1  # 30 layers: qkv, o, gate/up, down; lm_head (tuned run + forced run)
    ours = _generate(llm)

    from transformers import AutoModelForCausalLM

    path = model_directory(resolve_model_source(DEFAULT_MODEL_ID), llm.cache_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    # packed weights replace the [K, N] copies, nothing doubles: the model's parameters plus the
    # buffers (rotary inv_freq) and the second layout of the tied lm_head (the embedding keeps its [V, K] table),
    # plus the second layouts the tuned run keeps on purpose (fxc::linear_by_m, capped by its budget)
    dual = sum(h.get("dual_layout_bytes", 0) for h in llm._build.context.history if h["pass"] == "lower_cpu_kernels")
    budget = sum(t.numel() * 4 for t in [*hf.parameters(), *hf.buffers()]) + hf.lm_head.weight.numel() * 4 + dual
    assert _param_bytes(llm) <= budget
    for prompt, out in zip(PROMPTS, ours):
        _check_against_hf(hf, llm.tokenizer(prompt)["input_ids"], out)
