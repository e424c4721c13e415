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

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "List three colours:",
    "Water boils at",
    ("The theory of relativity, proposed by Albert Einstein in the early twentieth century, changed our "
     "understanding of space and time. In simple terms, it says that"),
    "Hello",
    "Translate to French: I like apples.",
]
NEW_TOKENS = 32
TIE = 1e-4
SP = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _insert(p):
    return {"passes": {"insert": [(p, {"after": "fuse_projections"})]}}


def _generate(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)]


def _lowering(llm) -> dict:
    return next(h for h in llm._build.context.history if h["pass"] == "lower_cpu_kernels")


def _param_bytes(llm) -> int:
    return sum(t.numel() * t.element_size() for t in llm._build.params.values())


def _check_against_hf(hf_model, prompt_ids: list[int], ours: list[int]) -> None:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=len(ours),
                                eos_token_id=None, output_scores=True, return_dict_in_generate=True,
                                pad_token_id=hf_model.config.eos_token_id)
    ref = out.sequences[0, len(prompt_ids):].tolist()
    for step, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = out.scores[step][0].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < TIE, f"diverged at step {step} ({a} vs {b}) where transformers' top-2 gap is {gap}"
            return
    assert ours == ref


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
    # buffers (rotary inv_freq) and the second layout of the tied lm_head (the embedding keeps its [V, K] table)
    budget = sum(t.numel() * 4 for t in [*hf.parameters(), *hf.buffers()]) + hf.lm_head.weight.numel() * 4
    assert _param_bytes(llm) <= budget
    for prompt, out in zip(PROMPTS, ours):
        _check_against_hf(hf, llm.tokenizer(prompt)["input_ids"], out)
