"""Quantized KV caches (KV8 int8, KVf8 fp8 e4m3) under tensor / pipeline / data parallelism: each rank's cache
holds its KV heads and its stage's layers, with the matching slice of the model's static per-layer, per-KV-head
scales (``fxcompiler.parallel_llm.rank_kv_scales``); the greedy tokens equal the one-process run's with the
same scales, exactly."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fxcompiler import LLM, ManualBucketConfig, SamplingParams
from fxcompiler.parallel_llm import rank_kv_scales
from runtime.block_manager import PagedKVCache

# the model's scales: layer l, KV head h holds 10 * l + h (k) and 100 + 10 * l + h (v)
K = torch.tensor([[0.0, 1.0], [10.0, 11.0], [20.0, 21.0], [30.0, 31.0]]) + 1.0
V = K + 100.0
CONFIG = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)


def _slice(plan: dict, rank: int) -> tuple[list, list]:
    full = {"tp": 1, "pp": 1, "dp": 1, **plan}
    k, v = rank_kv_scales((K, V), CONFIG, {"plan": full, "rank": rank, "group": "g"})
    return k.tolist(), v.tolist()


def test_rank_scales_are_the_stage_layers_and_kv_heads_of_the_rank():
    # tp = 2: a KV head each, every layer
    assert _slice({"tp": 2}, 0) == (K[:, :1].tolist(), V[:, :1].tolist())
    assert _slice({"tp": 2}, 1) == (K[:, 1:].tolist(), V[:, 1:].tolist())
    # pp = 2: both heads, the stage's layers (renumbered from 0); uneven stages
    assert _slice({"pp": 2}, 1)[0] == K[2:].tolist()
    assert _slice({"pp": 2, "num_blocks_per_pp_stage": [3, 1]}, 0)[0] == K[:3].tolist()
    assert _slice({"pp": 2, "num_blocks_per_pp_stage": [3, 1]}, 1)[1] == V[3:].tolist()
    # tp = 4 > 2 KV heads: replicated, ranks 0-1 read KV head 0, ranks 2-3 KV head 1
    assert [_slice({"tp": 4}, r)[0] for r in range(4)] == [K[:, :1].tolist()] * 2 + [K[:, 1:].tolist()] * 2
    # tp = 2 x pp = 2 x dp = 2 (torchrun's global ranks): a replica takes the slice of the same (stage, tp rank)
    plan = {"tp": 2, "pp": 2, "dp": 2}
    assert _slice(plan, 3) == _slice(plan, 7) == (K[2:, 1:].tolist(), V[2:, 1:].tolist())
    assert _slice(plan, 4) == (K[:2, :1].tolist(), V[:2, :1].tolist())


def test_rank_scales_of_the_wrong_shape_name_the_model_shape():
    with pytest.raises(ValueError, match=r"k_scale must be \[num_layers=4, num_kv_heads=2\], got \[4, 1\]"):
        rank_kv_scales((K[:, :1], V[:, :1]), CONFIG, {"plan": {"tp": 2}, "rank": 0, "group": "g"})


# ---- end to end: spawned rank workers (tiny float64 Llama: 2 layers, 4 heads, 2 KV heads) --------------------

KW = dict(dtype="float64", max_seq_len_to_capture=64, paged_attention_block_size=4,
          bucket_config=ManualBucketConfig(prefill_buckets=[(1, 16), (4, 16)], decode_buckets=[(4, 64)]))
PROMPTS = [[1] + [(7 * i + 13 * j) % 250 + 3 for j in range(2 + (5 * i) % 11)] for i in range(6)]
PARAMS = [SamplingParams(temperature=0, max_tokens=8 + (3 * i) % 9, ignore_eos=True) for i in range(6)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.conftest import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("kvp") / "llama", "llama", tie_word_embeddings=True))


@pytest.fixture(scope="module")
def kvp_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kvp-cache")


_REFERENCES: dict = {}


def _reference(dtype: str, tiny_llama, kvp_cache):
    """One process's calibrated scales and greedy tokens for ``dtype`` (built once per dtype)."""
    if dtype not in _REFERENCES:
        with LLM(tiny_llama, kv_cache_dtype=dtype, cache_dir=kvp_cache, **KW) as one:
            tokens = [o.outputs[0].token_ids for o in one.generate(None, PARAMS, prompt_token_ids=PROMPTS)]
            _REFERENCES[dtype] = (one.kv_cache_scales, tokens)
    return _REFERENCES[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, plan", [("int8", "tp"), ("int8", "pp"), ("int8", "dp"), ("fp8", "tp")])
def test_parallel_quantized_cache_tokens_equal_one_process(tiny_llama, kvp_cache, dtype, plan):
    (k, v), want = _reference(dtype, tiny_llama, kvp_cache)
    size = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "dp": "data_parallel_size"}[plan]
    # dp: in-process replicas, calibrated on one replica (the one-process calibration); tp / pp: the scales given
    scales = {} if plan == "dp" else {"kv_cache_scales": (k, v)}
    with LLM(tiny_llama, kv_cache_dtype=dtype, cache_dir=kvp_cache, **{size: 2}, **scales, **KW) as llm:
        assert all(torch.equal(a, b) for a, b in zip(llm.kv_cache_scales, (k, v)))
        got = [o.outputs[0].token_ids for o in llm.generate(None, PARAMS, prompt_token_ids=PROMPTS)]
        assert got == want
        g, plan_kv = llm.geometry, llm.kv_cache_plan  # a rank's geometry: its KV heads, its stage's layers
        assert (g.num_kv_heads, g.num_layers) == {"tp": (1, 2), "pp": (2, 1), "dp": (2, 2)}[plan]
        per_block = PagedKVCache.bytes_per_block(g.num_layers, 4, g.num_kv_heads, g.head_dim,
                                                 torch.int8 if dtype == "int8" else torch.float8_e4m3fn)
        assert plan_kv.bytes == plan_kv.num_blocks * per_block  # one byte per cached value in every rank
        if plan == "dp":
            assert len(llm.engine.replicas) == 2 and min(llm.engine.routed) >= 1
            assert all(r.runner.kv.k[0].dtype == torch.int8 for r in llm.engine.replicas)

