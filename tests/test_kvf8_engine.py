"""The fp8 e4m3 KV cache (KVf8) inside the engine: prefix caching and preemption give the tokens a plain KVf8
run gives with the same static scales and return every block; the artifact round trip keeps the fp8 cache and
its scales; furiosa's KVf8 schemes (``W8A32KVf8``, a qformat's ``--kv_dtype fp8``) turn it on; conflicts raise."""
from __future__ import annotations

import pytest
import torch

from fxcompiler import LLM, SamplingParams

from .test_kv8_engine import PROMPTS, SP, _all_blocks_free, _tokens

F8 = torch.float8_e4m3fn


def _llm(path, **kw) -> LLM:
    kw.setdefault("enable_prefix_caching", False)
    return LLM(str(path), dtype="float32", cache_dir=None, kv_cache_dtype="fp8_e4m3", max_seq_len_to_capture=128,
               paged_attention_block_size=4, **kw)


@pytest.fixture(scope="module")
def reference(tiny_models):
    """A KVf8 run with the built-in calibration (amax x 1.05 / 448 per layer and KV head)."""
    llm = _llm(tiny_models["llama"])
    try:
        assert llm.kv_cache_dtype == "fp8" and llm.engine.runner.kv.k[0].dtype == F8
        k, v = llm.kv_cache_scales
        assert k.shape == (llm.geometry.num_layers, llm.geometry.num_kv_heads) and bool((k > 0).all())
        outs = _tokens(llm.generate(None, SP, prompt_token_ids=PROMPTS))
    finally:
        llm.shutdown()
    float_llm = LLM(str(tiny_models["llama"]), dtype="float32", cache_dir=None, max_seq_len_to_capture=128,
                    paged_attention_block_size=4, enable_prefix_caching=False)
    try:
        float_outs = _tokens(float_llm.generate(None, SP, prompt_token_ids=PROMPTS))
    finally:
        float_llm.shutdown()
    yield (k, v), outs, float_outs


def test_fp8_cache_decodes_close_to_the_float_cache(reference):
    """The fp8 cache is not exact, and the random tiny model's distributions are flat (after a first difference the
    continuations diverge): its first greedy token after every prompt is the float cache's, and the first three
    tokens of most prompts are."""
    _, outs, float_outs = reference
    assert [o[0] for o in outs] == [f[0] for f in float_outs], (outs, float_outs)
    assert sum(o[:3] == f[:3] for o, f in zip(outs, float_outs)) >= 3, (outs, float_outs)


def test_prefix_cache_hits_give_the_same_tokens(tiny_models, reference):
    scales, ref, _ = reference
    llm = _llm(tiny_models["llama"], kv_cache_scales=scales, enable_prefix_caching=True)
    try:
        first = _tokens(llm.generate(None, SP, prompt_token_ids=PROMPTS))
        again = _tokens(llm.generate(None, SP, prompt_token_ids=PROMPTS))
        assert llm.engine.stats.prefix_cache_hits > 0
        assert first == ref and again == ref
        _all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_preempted_requests_recompute_the_same_tokens(tiny_models, reference):
    scales, ref, _ = reference
    llm = _llm(tiny_models["llama"], kv_cache_scales=scales, paged_attention_num_blocks=24)
    try:
        assert _tokens(llm.generate(None, SP, prompt_token_ids=PROMPTS)) == ref
        assert llm.engine.stats.preemptions > 0
        _all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_artifact_round_trip_keeps_the_fp8_cache_and_its_scales(tiny_models, reference, tmp_path):
    scales, ref, _ = reference
    path = tmp_path / "kvf8-artifact"
    built = _llm(tiny_models["llama"], kv_cache_scales=scales, artifacts_export_path=path, skip_engine=True)
    built.shutdown()
    loaded = LLM.load_artifact(path, cache_dir=None)
    try:
        assert loaded.kv_cache_dtype == "fp8" and loaded.engine.runner.kv.k[0].dtype == F8
        assert all(torch.equal(a, b) for a, b in zip(loaded.kv_cache_scales, scales))
        assert _tokens(loaded.generate(None, SP, prompt_token_ids=PROMPTS)) == ref
        _all_blocks_free(loaded)
    finally:
        loaded.shutdown()
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8': the artifact .* was built with fp8 KV cache scales"):
        LLM.load_artifact(path, cache_dir=None, kv_cache_dtype="int8")


def test_a_kvf8_quantization_config_turns_on_the_fp8_cache(tiny_models, reference, tmp_path):
    """``W8A32KVf8`` and a qformat's ``--kv_dtype fp8`` run the fp8 cache with the weight scheme: the tokens of the
    weight scheme with ``kv_cache_dtype="fp8"`` and the same scales."""
    from fxcompiler import LLMConfig, QuantizationConfig

    scales, _, _ = reference
    path = tiny_models["llama"]
    ref = _llm(path, kv_cache_scales=scales, llm_config=LLMConfig(quantization_config=QuantizationConfig.from_str("W8A32")))
    try:
        want = _tokens(ref.generate(None, SP, prompt_token_ids=PROMPTS))
    finally:
        ref.shutdown()
    qformat = tmp_path / "qformat.yaml"
    qformat.write_text("--weight_dtype int8 --act_dtype fp32 --kv_dtype fp8-E4M3\nmodules:\n  \"*\": {weight: int8}\n")
    for kw in (dict(llm_config=LLMConfig(quantization_config=QuantizationConfig.from_str("W8A32KVf8"))),
               dict(qformat_path=qformat)):
        llm = LLM(str(path), dtype="float32", cache_dir=None, max_seq_len_to_capture=128, paged_attention_block_size=4,
                  enable_prefix_caching=False, kv_cache_scales=scales, **kw)
        try:
            assert llm.kv_cache_dtype == "fp8" and llm.engine.runner.kv.k[0].dtype == F8
            assert _tokens(llm.generate(None, SP, prompt_token_ids=PROMPTS)) == want
            _all_blocks_free(llm)
        finally:
            llm.shutdown()


def test_conflicting_kv_dtypes_are_refused(tiny_models):
    from fxcompiler import LLMConfig, QuantizationConfig

    path = str(tiny_models["llama"])
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' conflicts with llm_config.quantization_config=W8A16KV16"):
        LLM(path, kv_cache_dtype="fp8", llm_config=LLMConfig(quantization_config=QuantizationConfig.from_str("W8A16KV16")))
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' conflicts with the quantization's fp8 KV cache"):
        LLM(path, kv_cache_dtype="int8", llm_config=LLMConfig(quantization_config=QuantizationConfig.from_str("W8A16KVf8")))
    with pytest.raises(NotImplementedError, match=r"kv_cache_dtype='fp8' with tensor/pipeline parallelism .* needs kv_cache_scales"):
        LLM(path, kv_cache_dtype="fp8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' with skip_engine=True needs kv_cache_scales"):
        LLM(path, kv_cache_dtype="fp8", skip_engine=True, cache_dir=None, max_seq_len_to_capture=128)


def test_beams_share_fp8_blocks(tiny_models, reference):
    from fxcompiler.config import KvCacheSharingAcrossBeamsConfig

    from .test_kv8_engine import check_beams_share_quantized_blocks

    scales, _, _ = reference
    llm = _llm(tiny_models["llama"], kv_cache_scales=scales,
               kv_cache_sharing_across_beams_config=KvCacheSharingAcrossBeamsConfig(4, 12))
    try:
        assert llm.engine.runner.kv.k[0].dtype == F8
        check_beams_share_quantized_blocks(llm)
    finally:
        llm.shutdown()
