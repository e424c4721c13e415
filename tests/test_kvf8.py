"""The fp8 e4m3 KV cache (KVf8): the e4m3 codec against torch's float8_e4m3fn casts, the kernels (decode and
flash paths, the AVX2 build) against the reference, the quantizing write and the kv_cache_dtype names."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fxcompiler.kv_cache_quant import check_kv_scales, load_kv_scales, parse_kv_cache_dtype, save_kv_scales
from fxcompiler.ops.paged_attention import (FP8_MAX, kv8_scales, kv8_set_scales, kvf8_quantize,
                                            paged_attention_reference, write_kv_reference)
from runtime.block_manager import PagedKVCache
from tests.test_kv8 import _problem as kv8_problem

F8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def kernels():
    from backends.cpu.attention import install, kernel_module

    mod = kernel_module()
    assert mod is not None, "the C++ paged-attention module must build on CI machines"
    install()
    return mod


def _codes(g, shape):
    """Random e4m3 bytes, NaN codes (0x7F / 0xFF) excluded: a cache written from finite values never holds them."""
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    raw[(raw & 0x7F) == 0x7F] = 0x7E  # the largest finite magnitude, 448
    return raw.view(F8)


def _problem(seed, B, Hkv, G, D, bs, S, ctx, dtype):
    return kv8_problem(seed, B, Hkv, G, D, bs, S, ctx, dtype, codes=_codes, scale_range=(0.002, 0.022))


def _bytes_equal(a, b) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _check(out, ref, vc, bf16):
    # fp32: the kernels read the same exact e4m3 values as the reference; only the summation order differs.
    # bf16: the bound of test_kv8 (6 bf16 ulps of the largest |V|: outputs are convex combinations of V rows).
    if bf16:
        v_max = FP8_MAX * kv8_scales(vc).max().item()
        torch.testing.assert_close(out.float(), ref, atol=6 * 2 ** -8 * v_max, rtol=0)
    else:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


# -- the codec -------------------------------------------------------------------------------------------------
def test_every_code_decodes_as_torch_does(kernels):
    """All 256 codes through the decode kernel's conversion: a one-token context whose V row holds 16 codes and
    scale 1, with a K row of zeros, gives back exactly V (softmax of one key is 1); NaN codes give NaN."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(F8)
    want = codes.to(torch.float32)
    for D in (16, 24):  # the AVX-512 loads (head_dim 16/32/64/128) and the portable loop
        got = []
        for chunk in codes.split(D) if D == 16 else [codes[i:i + D] for i in range(0, 256, D)]:
            n = chunk.numel()
            kc = torch.zeros(3, 1, 1, D, dtype=F8)
            vc = torch.zeros(3, 1, 1, D, dtype=F8)
            vc.view(torch.uint8)[1, 0, 0, :n] = chunk.view(torch.uint8)
            kv8_set_scales(kc, [1.0])
            kv8_set_scales(vc, [1.0])
            q = torch.zeros(1, 1, 1, D)
            # no new row is written at slot 0 (the null block) and the context is slot 1 (block 1, one token)
            out = torch.ops.fxc.paged_attention(q, q, q, kc, vc, torch.tensor([[1]]), torch.tensor([[0]]),
                                                torch.tensor([[0]]), torch.tensor([1]), 1.0)
            got.append(out.reshape(-1)[:n])
        got = torch.cat(got)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        fin = ~torch.isnan(want)
        assert torch.equal(got[fin], want[fin])


@settings(max_examples=60, deadline=None)
@given(x=st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1, max_size=64),
       scale=st.floats(1e-3, 10.0))
def test_encoder_equals_torchs_saturating_cast(kernels, x, scale):
    """The C++ write and the reference give the bits of torch's cast of clamp(x / s, -448, 448): round to
    nearest even, saturating at +-448 (never NaN for finite x)."""
    D = len(x)
    key = torch.tensor(x, dtype=torch.float32).view(1, 1, 1, D)
    s = torch.tensor([scale], dtype=torch.float32)
    want = (key / s).clamp(-FP8_MAX, FP8_MAX).to(F8)
    assert _bytes_equal(kvf8_quantize(key, s, 1), want)
    kc = torch.zeros(3, 4, 1, D, dtype=F8)  # blocks of 4 tokens: room for the scale whatever D is
    vc = torch.zeros_like(kc)
    kv8_set_scales(kc, s)
    kv8_set_scales(vc, s)
    kernels.write_cache_q8(key, key, kc, vc, torch.tensor([[4]]))
    assert _bytes_equal(kc[1, 0, 0], want.reshape(-1)) and _bytes_equal(vc[1, 0, 0], want.reshape(-1))
    assert not bool(torch.isnan(kc[1].float()).any())
    back = kc[1, 0, 0].float() * scale
    inside = key.reshape(-1).abs() <= FP8_MAX * scale
    # half an e4m3 ulp: 2^-4 relative for normals, 2^-10 of the scale below 2^-6 (subnormals)
    err = (back - key.reshape(-1)).abs()[inside]
    bound = torch.maximum(key.reshape(-1).abs()[inside] / 16, torch.tensor(scale * 2 ** -10))
    assert bool((err <= bound * (1 + 1e-6)).all())


# -- the kernels -----------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), B=st.integers(1, 3), Hkv=st.integers(1, 3), G=st.sampled_from([1, 2, 3, 4]),
       D=st.sampled_from([16, 32, 64, 24]), bs=st.sampled_from([1, 4, 16]), S=st.sampled_from([1, 2, 5, 17]),
       ctx=st.lists(st.integers(0, 40), min_size=3, max_size=3), bf16=st.booleans(),
       window=st.sampled_from([-1, 8]))
def test_kernel_matches_reference(kernels, seed, B, Hkv, G, D, bs, S, ctx, bf16, window):
    dtype = torch.bfloat16 if bf16 else torch.float32
    q, k, v, kc, vc, bt, slot, qpos, sl = _problem(seed, B, Hkv, G, D, bs, S, ctx, dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    ref = paged_attention_reference(q.float(), k.float(), v.float(), kc, vc, bt, slot, qpos, sl, D ** -0.5, window)
    out = torch.ops.fxc.paged_attention(q, k, v, kc2, vc2, bt, slot, qpos, sl, D ** -0.5, window)
    assert _bytes_equal(kc, kc2) and _bytes_equal(vc, vc2)  # the same codes written, scale blocks untouched
    assert out.dtype == dtype
    _check(out, ref, vc, bf16)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), B=st.integers(1, 2), Hkv=st.integers(1, 3), G=st.sampled_from([1, 3, 4]),
       S=st.sampled_from([2, 7, 20]), ctx=st.lists(st.integers(0, 40), min_size=2, max_size=2), bf16=st.booleans(),
       D=st.sampled_from([32, 24]), window=st.sampled_from([-1, 8]))
def test_flash_fp8_tiles_match_the_decode_kernel_and_the_reference(kernels, seed, B, Hkv, G, S, ctx, bf16, D, window):
    """Multi-token calls on an fp8 cache through the flash kernel (forced with ``_set_flash_min_rows(1)``) and
    the decode kernel (a huge threshold): both write the same bytes and equal the reference."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    q, k, v, kc, vc, bt, slot, qpos, sl = _problem(seed, B, Hkv, G, D, 4, S, ctx + [0], dtype)
    ref = paged_attention_reference(q.float(), k.float(), v.float(), kc.clone(), vc.clone(), bt, slot, qpos, sl,
                                    D ** -0.5, window)
    outs, caches = [], []
    for rows in (1, 10 ** 9):  # flash, then decode
        old = kernels._set_flash_min_rows(rows)
        try:
            kc2, vc2 = kc.clone(), vc.clone()
            outs.append(torch.ops.fxc.paged_attention(q, k, v, kc2, vc2, bt, slot, qpos, sl, D ** -0.5, window))
            caches.append((kc2, vc2))
        finally:
            kernels._set_flash_min_rows(old)
    assert _bytes_equal(caches[0][0], caches[1][0]) and _bytes_equal(caches[0][1], caches[1][1])
    for out in outs:
        _check(out, ref, vc, bf16)


_AVX2_SCRIPT = r"""
import torch
from backends.cpu.attention import install, kernel_module
from tests.test_kvf8 import _problem, _check, _bytes_equal
from fxcompiler.ops.paged_attention import paged_attention_reference
mod = kernel_module()
assert mod is not None and "avx2" in mod.__name__, mod
install()
for seed, S, bf16 in ((1, 1, False), (2, 5, True), (3, 20, False), (4, 17, True)):
    dtype = torch.bfloat16 if bf16 else torch.float32
    q, k, v, kc, vc, bt, slot, qpos, sl = _problem(seed, 2, 2, 4, 64, 4, S, [9, 30], dtype)
    ref = paged_attention_reference(q.float(), k.float(), v.float(), kc.clone(), vc.clone(), bt, slot, qpos, sl, 0.125)
    for rows in (1, 10 ** 9):
        old = mod._set_flash_min_rows(rows)
        kc2, vc2 = kc.clone(), vc.clone()
        out = torch.ops.fxc.paged_attention(q, k, v, kc2, vc2, bt, slot, qpos, sl, 0.125)
        mod._set_flash_min_rows(old)
        _check(out, ref, vc, bf16)
print("ok")
"""


@pytest.mark.slow
def test_avx2_build_matches_reference(kernels):
    """The AVX2 build (FXCOMPILER_CPU_ISA=avx2, its own kernel-cache entry) runs the portable decode loop and
    the AVX2 flash tiles on fp8 caches: the same bounds, in a fresh interpreter."""
    from backends.cpu import _build

    if _build.detect_isa() != "avx512":
        pytest.skip("this CPU builds the AVX2 kernels already: every test above ran them")
    env = dict(os.environ, FXCOMPILER_CPU_ISA="avx2")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", _AVX2_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-4000:]


# -- options and files ----------------------------------------------------------------------------------------
def test_kv_cache_dtype_names():
    for name in ("fp8", "FP8", "fp8_e4m3", "fp8-e4m3", torch.float8_e4m3fn):
        assert parse_kv_cache_dtype(name) == "fp8"
    for bad in ("fp8_e5m2", "float16", torch.float8_e5m2, 8):
        with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'int8', 'fp8'\]"):
            parse_kv_cache_dtype(bad)


def test_fp8_cache_tensors_and_scales(tmp_path):
    k = torch.rand(2, 3) + 0.1
    cache = PagedKVCache(2, 5, 4, 3, 8, F8, torch.device("cpu"), kv_scales=(k, k * 2))
    assert cache.k[0].dtype == F8 and cache.k[0].shape[0] == 6  # + the scale block
    assert torch.equal(kv8_scales(cache.k[1]), k[1]) and torch.equal(kv8_scales(cache.v[1]), 2 * k[1])
    with pytest.raises(ValueError, match="int8 or fp8 KV cache needs kv_scales"):
        PagedKVCache(2, 5, 4, 3, 8, F8, torch.device("cpu"))
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn cache"):
        kv8_set_scales(torch.zeros(3, 4, 3, 8), [1.0, 1.0, 1.0])
    # copy-on-write copies whole blocks, codes and all
    cache.k[0].view(torch.uint8)[2].fill_(0x38)  # 1.0
    cache.copy_blocks([(2, 3)])
    assert bool((cache.k[0][3].float() == 1.0).all())
    path = save_kv_scales(tmp_path, k, k, kv_dtype="fp8")
    assert load_kv_scales(path)["kv_cache_dtype"] == "fp8"
    # one number (vLLM's unit scales) and per-layer scales broadcast over the KV heads
    ones = check_kv_scales(1.0, 2, 3)
    assert all(bool((t == 1).all()) and t.shape == (2, 3) for t in ones)
    per_layer = check_kv_scales(([0.5, 0.25], [1.0, 2.0]), 2, 3)
    assert torch.equal(per_layer[0][:, 2], torch.tensor([0.5, 0.25]))
    with pytest.raises(ValueError, match="k_scale must be finite and > 0"):
        check_kv_scales(0.0, 2, 3)
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        save_kv_scales(tmp_path, k, k, kv_dtype="fp16")


def test_reference_write_is_the_cast(kernels):
    """write_kv_reference on an fp8 cache stores kvf8_quantize's bytes at the slots (byte views: torch has no
    fp8 index_copy_) and leaves every other slot and the scale block alone."""
    g = torch.Generator().manual_seed(3)
    kc = torch.zeros(4, 2, 2, 8, dtype=F8)
    vc = torch.zeros_like(kc)
    s = torch.tensor([0.01, 0.2])
    kv8_set_scales(kc, s)
    kv8_set_scales(vc, s)
    key = torch.randn(1, 2, 3, 8, generator=g) * 3
    write_kv_reference(key, -key, kc, vc, torch.tensor([[2, 3, 5]]))
    want = kvf8_quantize(key, s, 1).transpose(1, 2).reshape(3, 2, 8)
    assert _bytes_equal(kc.view(8, 2, 8)[[2, 3, 5]], want)
    assert _bytes_equal(vc.view(8, 2, 8)[[2, 3, 5]], kvf8_quantize(-key, s, 1).transpose(1, 2).reshape(3, 2, 8))
    assert bool((kc.view(8, 2, 8)[[0, 1, 4]].float() == 0).all())
    assert torch.equal(kv8_scales(kc), s)
