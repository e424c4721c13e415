"""End to end: the embedded SmolLM2 Q4_1 GGUF run on its own blocks (``keep_gguf_quantization=True``).

Every Q4_1/Q8_0 tensor is repacked without dequantisation and checked, inside the ``quantize`` pass, to
dequantise to transformers' fp32 tensor (a mismatch raises); greedy tokens equal transformers' fp32
dequantised model (divergence allowed only at a near-tie, the rule of tests/test_smollm2.py).
"""
from __future__ import annotations

import pytest
import torch

from fxcompiler import LLM, SamplingParams
from fxcompiler.models.loader import model_directory
from fxcompiler.models.sources import DEFAULT_MODEL_ID, resolve_model_source

from .test_smollm2 import PROMPTS, _check_against_hf

pytestmark = pytest.mark.slow


def test_native_q4_1_greedy_matches_transformers_fp32():
    from fxcompiler import ManualBucketConfig

    llm = LLM(DEFAULT_MODEL_ID, keep_gguf_quantization=True, max_seq_len_to_capture=256,
              bucket_config=ManualBucketConfig([(1, 64)], [(1, 256)]))
    info = next(h for h in llm._build.context.history if h["pass"] == "quantize")
    # 30 layers x (qkv, o, gate_up, down) in Q4_1, and the tied output on the Q8_0 token_embd blocks (the default)
    assert info["native"] == 4 * 30 + 1 and info["exact_checked"] == 4 * 30 + 1 and info["kept"] == 0, info
    # the embedding lookup reads the output projection's Q8_0 tensors (fxc::embedding_w8): no fp32 copy of a
    # quantized table survives the build, and the table is held once
    assert info["embeddings"] == 1, info
    assert sorted(k for k in llm._build.params if "lm_head" in k or "embed" in k) == [
        "model.lm_head.weight.T.q", "model.lm_head.weight.T.scales"]
    assert not any(t.dtype == torch.float32 and t.numel() >= 1 << 20 for t in llm._build.params.values())
    assert llm.quantization["scheme"] == "gguf-native"
    packed = sum(t.numel() * t.element_size() for k, t in llm._build.params.items()
                 if k.endswith((".q", ".scales", ".mins")) and "lm_head" not in k)
    assert packed < 90e6  # the layers: int4 codes + fp16 scale/min per 32, 0.625 byte per weight (fp32: 4)
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24,
                                                                                 ignore_eos=True))]
    from transformers import AutoModelForCausalLM

    path = model_directory(resolve_model_source(DEFAULT_MODEL_ID), llm.cache_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs):
        _check_against_hf(hf, llm.tokenizer(prompt)["input_ids"], out)
