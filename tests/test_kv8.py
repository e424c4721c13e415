"""The int8 KV cache (KV8): kernels against the reference, the quantizing write, the kv_cache_dtype
option, block planning, calibration and the held-out perplexity of the embedded SmolLM2-135M."""
from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fxcompiler import LLM, SamplingParams
from fxcompiler.engine_args import EngineArgs
from fxcompiler.kv_cache_quant import (check_kv_scales, load_kv_scales, parse_kv_cache_dtype, save_kv_scales)
from fxcompiler.ops.paged_attention import (kv8_quantize, kv8_scales, kv8_set_scales, paged_attention_reference,
                                            write_kv_reference)
from runtime.block_manager import PagedKVCache

from fxcompiler.models.sources import DEFAULT_MODEL_ID

from .test_smollm2 import PROMPTS


@pytest.fixture(scope="module")
def kernels():
    from backends.cpu.attention import kernel_module

    mod = kernel_module()
    assert mod is not None, "the C++ paged-attention module must build on CI machines"
    return mod


def _int8_codes(g, shape):
    return torch.randint(-127, 128, shape, dtype=torch.int8, generator=g)


def _problem(draw_seed, B, Hkv, G, D, bs, S, ctx, dtype, codes=_int8_codes, scale_range=(0.01, 0.05)):
    """A random paged-attention problem on a quantized cache (``codes(g, shape)`` draws the cache's codes; the
    per-KV-head scales are uniform in ``scale_range``)."""
    g = torch.Generator().manual_seed(draw_seed)
    Hq = Hkv * G
    mb = -(-(max(ctx) + S) // bs)
    nb = B * mb + 2  # null block, the sequences' blocks, the scale block
    kc, vc = codes(g, (nb, bs, Hkv, D)), codes(g, (nb, bs, Hkv, D))
    lo, hi = scale_range
    kv8_set_scales(kc, torch.rand(Hkv, generator=g) * (hi - lo) + lo)
    kv8_set_scales(vc, torch.rand(Hkv, generator=g) * (hi - lo) + lo)
    perm = torch.randperm(nb - 2, generator=g) + 1
    bt = perm[: B * mb].view(B, mb).contiguous()
    L0 = torch.tensor(ctx[:B])
    qpos = L0.view(B, 1) + torch.arange(S).view(1, S)
    slot = torch.stack([bt[b][qpos[b] // bs] * bs + qpos[b] % bs for b in range(B)])
    q = torch.randn(B, Hq, S, D, generator=g).to(dtype)
    k = (torch.randn(B, Hkv, S, D, generator=g) * 2).to(dtype)
    v = (torch.randn(B, Hkv, S, D, generator=g) * 2).to(dtype)
    return q, k, v, kc, vc, bt, slot, qpos, L0 + S


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), B=st.integers(1, 3), Hkv=st.integers(1, 3), G=st.sampled_from([1, 2, 3, 4]),
       D=st.sampled_from([16, 32, 64, 24]), bs=st.sampled_from([1, 4, 16]), S=st.sampled_from([1, 2, 5, 17]),
       ctx=st.lists(st.integers(0, 40), min_size=3, max_size=3), bf16=st.booleans(),
       window=st.sampled_from([-1, 8]))
def test_kernel_matches_reference(kernels, seed, B, Hkv, G, D, bs, S, ctx, bf16, window):
    dtype = torch.bfloat16 if bf16 else torch.float32
    q, k, v, kc, vc, bt, slot, qpos, sl = _problem(seed, B, Hkv, G, D, bs, S, ctx, dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    # The reference in fp32 (bf16 inputs are exact in fp32, so the same codes are written). A bf16 kernel's
    # rounding (dequantized K in the scores, P and V in the sum, the output) is bounded by the scale of
    # the values, not of each output element: an output is a convex combination of V rows, and near-
    # cancelling sums make element-relative tolerances meaningless. Measured worst 3.1 * 2^-8 * max|V|
    # over 600 random cases (AVX2); the bound allows 6.
    ref = paged_attention_reference(q.float(), k.float(), v.float(), kc, vc, bt, slot, qpos, sl, D ** -0.5, window)
    out = torch.ops.fxc.paged_attention(q, k, v, kc2, vc2, bt, slot, qpos, sl, D ** -0.5, window)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # the same codes written, scale blocks untouched
    if bf16:
        v_max = 127 * kv8_scales(vc).max().item()
        torch.testing.assert_close(out.float(), ref, atol=6 * 2 ** -8 * v_max, rtol=0)
    else:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the reference itself against float attention over the dequantized cache
    assert out.dtype == dtype


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), B=st.integers(1, 2), Hkv=st.integers(1, 3), G=st.sampled_from([1, 3, 4]),
       S=st.sampled_from([2, 7, 20]), ctx=st.lists(st.integers(0, 40), min_size=2, max_size=2), bf16=st.booleans(),
       window=st.sampled_from([-1, 8]))
def test_flash_int8_tiles_match_the_decode_kernel_and_the_reference(kernels, seed, B, Hkv, G, S, ctx, bf16, window):
    """Multi-token calls on an int8 cache take the flash kernel's int8 tiles (forced here for every shape with
    ``_set_flash_min_rows(1)``; the decode kernel with a huge threshold): both equal the reference within the
    bounds of test_kernel_matches_reference, and write the same codes."""
    from backends.cpu.attention import kernel_module

    dtype = torch.bfloat16 if bf16 else torch.float32
    D, bs = 32, 4
    q, k, v, kc, vc, bt, slot, qpos, sl = _problem(seed, B, Hkv, G, D, bs, S, ctx + [0], dtype)
    ref = paged_attention_reference(q.float(), k.float(), v.float(), kc.clone(), vc.clone(), bt, slot, qpos, sl,
                                    D ** -0.5, window)
    mod = kernel_module()
    outs, caches = [], []
    for rows in (1, 10 ** 9):  # flash, then decode
        old = mod._set_flash_min_rows(rows)
        try:
            kc2, vc2 = kc.clone(), vc.clone()
            outs.append(torch.ops.fxc.paged_attention(q, k, v, kc2, vc2, bt, slot, qpos, sl, D ** -0.5, window))
            caches.append((kc2, vc2))
        finally:
            mod._set_flash_min_rows(old)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    for out in outs:
        assert out.dtype == dtype
        if bf16:
            v_max = 127 * kv8_scales(vc).max().item()
            torch.testing.assert_close(out.float(), ref, atol=6 * 2 ** -8 * v_max, rtol=0)
        else:
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), Hkv=st.integers(1, 4), amp=st.floats(0.01, 50.0), bf16=st.booleans())
def test_write_round_trips_within_half_a_scale(kernels, seed, Hkv, amp, bf16):
    g = torch.Generator().manual_seed(seed)
    B, S, D, bs, nb = 2, 5, 32, 4, 8
    scales = torch.rand(Hkv, generator=g) * amp / 127 + 1e-4
    k = ((torch.rand(B, Hkv, S, D, generator=g) * 2 - 1) * scales.view(1, Hkv, 1, 1) * 127)
    k = k.to(torch.bfloat16 if bf16 else torch.float32)
    slot = torch.arange(4, 4 + B * S).view(B, S)
    for write in ("reference", "kernel"):
        kc = torch.zeros(nb, bs, Hkv, D, dtype=torch.int8)
        vc = torch.zeros_like(kc)
        kv8_set_scales(kc, scales)
        kv8_set_scales(vc, scales)
        if write == "reference":
            write_kv_reference(k, k, kc, vc, slot)
        else:
            kernels.write_cache_q8(k, k, kc, vc, slot)
        assert torch.equal(kv8_scales(kc), scales)
        codes = kc.view(nb * bs, Hkv, D)[slot.reshape(-1)]  # [B*S, Hkv, D]
        back = codes.float() * scales.view(1, Hkv, 1)
        orig = k.float().transpose(1, 2).reshape(B * S, Hkv, D)
        err = (back - orig).abs()
        assert bool((err <= scales.view(1, Hkv, 1) / 2 * (1 + 1e-5) + 1e-7).all())
        assert int(codes.abs().max()) <= 127
    # out of range values clamp to +-127
    big = torch.full((1, Hkv, 1, D), 1e6)
    assert int(kv8_quantize(big, scales, 1).min()) == 127


def test_avx2_kernel_in_subprocess_if_avx512_here(kernels):
    """The build here is what the CPU supports; the ISA is part of the kernel's name."""
    from backends.cpu import _build

    assert _build.detect_isa() in kernels.__name__


def test_kv_cache_dtype_errors():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'int8', 'fp8'\]"):
        parse_kv_cache_dtype("fp8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="int4")
    assert EngineArgs(kv_cache_dtype="INT8").llm_kwargs()["kv_cache_dtype"] == "int8"
    assert "kv_cache_dtype" not in EngineArgs().llm_kwargs()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM("does-not-matter", kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        check_kv_scales((torch.ones(2, 3), torch.ones(2, 3)), 2, 2)
    with pytest.raises(ValueError, match="finite and > 0"):
        check_kv_scales((torch.ones(2, 2), torch.zeros(2, 2)), 2, 2)


def test_int8_cache_block_count_and_scale_block():
    f32 = PagedKVCache.bytes_per_block(30, 16, 3, 64, torch.float32)
    i8 = PagedKVCache.bytes_per_block(30, 16, 3, 64, torch.int8)
    assert f32 == 4 * i8
    from fxcompiler.build import plan_kv_cache
    from fxcompiler.capture import ModelGeometry

    geo = ModelGeometry(30, 3, 64, 49152, torch.float32, 8192)
    args = dict(block_size=16, max_context=8192, max_decode_batch=256, max_processing_samples=64,
                num_blocks=None, memory_bytes=64 << 20)
    assert plan_kv_cache(geo, **args, kv_dtype=torch.int8).num_blocks - 1 == 4 * (plan_kv_cache(geo, **args).num_blocks - 1)
    ks, vs = torch.rand(2, 3) + 0.1, torch.rand(2, 3) + 0.1
    cache = PagedKVCache(2, 5, 4, 3, 8, torch.int8, torch.device("cpu"), kv_scales=(ks, vs))
    assert cache.k[0].shape[0] == 6 and cache.num_blocks == 5  # one scale block past the manager's blocks
    assert torch.equal(kv8_scales(cache.k[1]), ks[1]) and torch.equal(kv8_scales(cache.v[0]), vs[0])
    cache.copy_blocks([(1, 2)])
    assert torch.equal(kv8_scales(cache.k[1]), ks[1])
    with pytest.raises(ValueError, match="kv_scales"):
        PagedKVCache(2, 5, 4, 3, 8, torch.int8, torch.device("cpu"))


def test_tensor_parallel_int8_without_scales_is_refused(tiny_models):
    """The built-in calibration runs a one-process engine: rank workers need the scales given
    (tests/test_parallel_kv8.py runs tp / pp / dp with them)."""
    with pytest.raises(NotImplementedError, match="tensor/pipeline parallelism .* needs kv_cache_scales"):
        LLM(str(tiny_models["llama"]), kv_cache_dtype="int8", tensor_parallel_size=2)


# -- the real model --------------------------------------------------------------------------------------
def _perplexity(llm, ids, window=256, stride=128):
    nll, count, start = 0.0, 0, 0
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    while start < len(ids) - 1:
        chunk = ids[start:start + window]
        out = llm.generate(None, sp, prompt_token_ids=[chunk])[0]
        for pos in range(1 if start == 0 else window - stride, len(chunk)):
            nll -= out.prompt_logprobs[pos][chunk[pos]].logprob
            count += 1
        if start + window >= len(ids):
            break
        start += stride
    return math.exp(nll / count)


@pytest.fixture(scope="module")
def smol():
    base = LLM(DEFAULT_MODEL_ID)
    t0 = time.perf_counter()
    kv8 = LLM(DEFAULT_MODEL_ID, kv_cache_dtype="int8")
    kv8._build_seconds = time.perf_counter() - t0
    yield base, kv8
    base.shutdown()
    kv8.shutdown()


def test_smollm2_kv8_perplexity_and_greedy(smol, tmp_path):
    base, kv8 = smol
    assert kv8.engine.runner.kv.k[0].dtype == torch.int8
    assert base.engine.runner.kv.k[0].dtype != torch.int8
    ks, vs = kv8.kv_cache_scales
    assert ks.shape == (30, 3) and bool((ks > 0).all()) and bool((vs > 0).all())
    from fxcompiler.calibration import held_out_text

    ids = base.tokenizer(held_out_text(), add_special_tokens=False)["input_ids"][:1024]
    p_base, p_kv8 = _perplexity(base, ids), _perplexity(kv8, ids)
    rel = p_kv8 / p_base - 1
    print(f"\nheld-out PPL fp32 KV {p_base:.4f}, int8 KV {p_kv8:.4f}: {100 * rel:+.3f} %")
    assert rel < 0.01
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    a = [o.outputs[0].token_ids for o in base.generate(PROMPTS, sp)]
    b = [o.outputs[0].token_ids for o in kv8.generate(PROMPTS, sp)]
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    prefix = sum(next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), len(ra)) for ra, rb in zip(a, b))
    total = sum(len(r) for r in a)
    print(f"greedy agreement {same}/{total} positions, common prefix {prefix}/{total}")
    assert prefix >= 0.5 * total
    # the scales round-trip through a file and kv_cache_scales= gives the same engine
    path = save_kv_scales(tmp_path, ks, vs)
    k2, v2 = check_kv_scales(load_kv_scales(path), 30, 3)
    assert torch.equal(k2, ks) and torch.equal(v2, vs)
