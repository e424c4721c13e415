"""End to end: a llama GGUF with Q4_K, Q6_K and Q5_0 tensors (a Q4_K_M-style mix) run on its own blocks.

The model is a small random-weight llama written with gguf-py (SmolLM2's tokenizer fields, 2 layers of
width 256 so that K holds whole 256-value super-blocks). ``keep_gguf_quantization=True`` repacks every
matmul whose tensors share a layout (the ``quantize`` pass checks each dequantises bit for bit to
transformers' fp32 tensor, else raises); the fused q/k/v of a layer with a Q6_K ``attn_v`` beside Q4_K q/k
stays in float, and says so. Greedy tokens equal transformers' fp32 model of the same file (divergence
only at a near-tie, the rule of tests/test_smollm2.py).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fxcompiler import LLM, ManualBucketConfig, SamplingParams

from .test_smollm2 import _check_against_hf

pytestmark = pytest.mark.slow

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
QK_K = 256


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _q4_k(rng, n: int, k: int) -> np.ndarray:
    """Random Q4_K rows: 6-bit scales/mins, codes, and d/dmin that keep values within about ±0.1."""
    b = n * k // QK_K
    raw = rng.integers(0, 256, (b, 144), dtype=np.uint8)
    raw[:, 0:2] = _fp16_bytes(rng.uniform(1e-4, 2e-4, b))
    raw[:, 2:4] = _fp16_bytes(rng.uniform(1e-4, 2e-4, b) * 7.5)
    return raw.reshape(n, -1)


def _q6_k(rng, n: int, k: int) -> np.ndarray:
    b = n * k // QK_K
    raw = rng.integers(0, 256, (b, 210), dtype=np.uint8)
    raw[:, 192:208] = rng.integers(-24, 25, (b, 16)).astype(np.int8).view(np.uint8)
    raw[:, 208:210] = _fp16_bytes(rng.uniform(1e-4, 2e-4, b))
    return raw.reshape(n, -1)


def _q5_0(rng, n: int, k: int) -> np.ndarray:
    b = n * k // 32
    raw = rng.integers(0, 256, (b, 22), dtype=np.uint8)
    raw[:, 0:2] = _fp16_bytes(rng.uniform(2e-3, 6e-3, b))
    return raw.reshape(n, -1)


def write_k_quant_gguf(path, seed: int = 0) -> None:
    """The test model: layer 0's attn_v is Q6_K (q/k Q4_K), layer 1's is Q4_K; attn_output Q5_0, gate/up Q4_K,
    down Q6_K, the tied token embedding Q6_K, norms F32."""
    import gguf

    from fxcompiler.models.sources import DEFAULT_MODEL_ID, find_embedded_gguf

    src = gguf.GGUFReader(str(find_embedded_gguf(DEFAULT_MODEL_ID)))
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("k-quant test llama")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    w.add_vocab_size(vocab)
    w.add_tokenizer_model(src.fields["tokenizer.ggml.model"].contents())
    w.add_tokenizer_pre(src.fields["tokenizer.ggml.pre"].contents())
    w.add_token_list(src.fields["tokenizer.ggml.tokens"].contents())
    w.add_token_types(src.fields["tokenizer.ggml.token_type"].contents())
    w.add_token_merges(src.fields["tokenizer.ggml.merges"].contents())
    for name in ("bos", "eos", "unknown", "padding"):
        w.add_uint32(f"tokenizer.ggml.{name}_token_id", int(src.fields[f"tokenizer.ggml.{name}_token_id"].contents()))
    w.add_add_bos_token(False)
    Q = gguf.GGMLQuantizationType

    def add(name, raw, qtype):
        w.add_tensor(name, raw, raw_dtype=qtype)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    add("token_embd.weight", _q6_k(rng, vocab, HIDDEN), Q.Q6_K)
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm())
        add(p + "attn_q.weight", _q4_k(rng, HIDDEN, HIDDEN), Q.Q4_K)
        add(p + "attn_k.weight", _q4_k(rng, HIDDEN // HEADS * KV_HEADS, HIDDEN), Q.Q4_K)
        if i == 0:
            add(p + "attn_v.weight", _q6_k(rng, HIDDEN // HEADS * KV_HEADS, HIDDEN), Q.Q6_K)
        else:
            add(p + "attn_v.weight", _q4_k(rng, HIDDEN // HEADS * KV_HEADS, HIDDEN), Q.Q4_K)
        add(p + "attn_output.weight", _q5_0(rng, HIDDEN, HIDDEN), Q.Q5_0)
        w.add_tensor(p + "ffn_norm.weight", norm())
        add(p + "ffn_gate.weight", _q4_k(rng, FFN, HIDDEN), Q.Q4_K)
        add(p + "ffn_up.weight", _q4_k(rng, FFN, HIDDEN), Q.Q4_K)
        add(p + "ffn_down.weight", _q6_k(rng, HIDDEN, FFN), Q.Q6_K)
    w.add_tensor("output_norm.weight", norm())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("kquant") / "kquant-test.gguf"
    write_k_quant_gguf(path)
    return path


def test_k_quant_gguf_runs_on_its_blocks_and_matches_transformers(k_quant_gguf):
    from transformers import AutoModelForCausalLM

    from fxcompiler.models.loader import model_directory
    from fxcompiler.models.sources import resolve_model_source

    llm = LLM(str(k_quant_gguf), keep_gguf_quantization=True, max_seq_len_to_capture=128,
              bucket_config=ManualBucketConfig([(1, 32)], [(1, 128)]))
    info = next(h for h in llm._build.context.history if h["pass"] == "quantize")
    # layer 1's q/k/v, both o (Q5_0), gate/up (Q4_K) and down (Q6_K), and (the default) the lm_head from the Q6_K
    # embedding
    assert info["native"] == 8 and info["exact_checked"] == 8, info
    assert info["ops"] == {"w8": 5, "w4": 3}, info
    assert info["kept"] == 1 and list(info["gguf_mixed"].values()) == ["Q4_K+Q4_K+Q6_K"], info
    assert "model.layers.0.self_attn.q_proj" in next(iter(info["gguf_mixed"]))
    assert info["gguf_skipped"] == {}
    # the tied embedding's lookup reads the output projection's Q6_K tensors (fxc::embedding_w8): no fp32 table
    assert info["embeddings"] == 1, info
    assert sorted(k for k in llm._build.params if "lm_head" in k or "embed" in k) == [
        "model.lm_head.weight.T.q", "model.lm_head.weight.T.scales"]
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                                                 ignore_eos=True))]
    path = model_directory(resolve_model_source(str(k_quant_gguf)), llm.cache_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        _check_against_hf(hf, llm.tokenizer(prompt)["input_ids"], out)


def test_float_head_keeps_the_embedding_in_its_blocks(k_quant_gguf):
    """``quantize_lm_head=False``: the output projection stays in float (fxc::linear's packed copy), and the
    embedding lookup still reads the Q6_K blocks, packed once for it (no fp32 table survives)."""
    from transformers import AutoModelForCausalLM

    from fxcompiler.models.loader import model_directory
    from fxcompiler.models.sources import resolve_model_source

    llm = LLM(str(k_quant_gguf), keep_gguf_quantization=True, quantize_lm_head=False, max_seq_len_to_capture=128,
              bucket_config=ManualBucketConfig([(1, 32)], [(1, 128)]))
    info = next(h for h in llm._build.context.history if h["pass"] == "quantize")
    assert info["native"] == 7 and info["exact_checked"] == 8 and info["kept"] == 2 and info["embeddings"] == 1, info
    params = llm._build.params
    names = sorted(k for k in params if "lm_head" in k or "embed" in k)
    assert names == ["model.lm_head.weight.T.packed", "model.lm_head.weight.q", "model.lm_head.weight.scales"], names
    assert params["model.lm_head.weight.q"].dtype == torch.int8  # Q6_K codes, a scale per 16
    vocab = llm.model_config.vocab_size
    assert not any(t.dim() == 2 and t.shape[0] == vocab for t in params.values())
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    path = model_directory(resolve_model_source(str(k_quant_gguf)), llm.cache_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    _check_against_hf(hf, llm.tokenizer("The capital of France is")["input_ids"], out[0].outputs[0].token_ids)


def test_dequantised_gguf_types_are_logged_with_the_reason(caplog):
    from passes.quantize import _log_dequantised

    with caplog.at_level("INFO", logger="fxcompiler.passes"):
        _log_dequantised({"blk.0.ffn_down.weight": "Q5_K has no native int4/int8 layout here; dequantised by "
                          "transformers", "blk.1.ffn_down.weight": "Q5_K has no native int4/int8 layout here; "
                          "dequantised by transformers"}, {"model.layers.0.qkv": "Q4_K+Q4_K+Q6_K"})
    text = caplog.text
    assert "2 GGUF tensor(s) kept dequantised: Q5_K has no native int4/int8 layout" in text
    assert "1 fused matmul(s) kept dequantised" in text and "Q4_K+Q4_K+Q6_K" in text
