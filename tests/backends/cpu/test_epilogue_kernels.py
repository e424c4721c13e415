"""``fxc::linear_w8_silu_mul`` / ``fxc::linear_w8_add`` and ``fxc::linear_w4_silu_mul`` / ``fxc::linear_w4_add``: a W8 or
W4 linear with its gated-MLP product or its residual add formed in the linear's epilogue; ``fxc::linear_add`` /
``fxc::linear_by_m_add``, the same add for the float32 / bfloat16 linears. Each equals the graph it
replaces (the linear then ``fxc::silu_mul`` on the halves; ``residual + linear``) bit for bit on the kernel path this
process runs (``test_isa_paths`` reruns this file on the lower paths: AVX-512 without AMX, AVX2), fp32 and bf16,
per-channel and per-group scales (W4: fp32 and fp16 scales and mins), decode rows (the fused epilogue) and more (the
two ops in one call, AMX); the ATen-only forms (edf) stay close. Then bad widths and residuals. The passes that emit
them: ``tests/passes/test_linear_epilogue_fusion.py``.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.cpu import _build, attention, quant
from fxcompiler.ops.linear import (linear, linear_add, linear_add_aten, linear_add_reference, linear_by_m,
                                   linear_by_m_add, linear_by_m_add_dense, linear_by_m_add_reference,
                                   linear_by_m_dense, linear_w8, linear_w8_add, linear_w8_add_aten,
                                   linear_w8_reference, linear_w8_silu_mul, linear_w8_silu_mul_aten,
                                   linear_w8_silu_mul_reference, pack_linear_weight, quantize_linear_weight_int8)

pytestmark = pytest.mark.skipif(not _build.can_build(), reason="no C++ toolchain or AVX2: the fxc kernels are not built")


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    assert _build.ensure_loaded(), _build.state().get("error")
    assert quant.ensure_loaded()
    assert attention.install()  # fxc::silu_mul's kernel: the fused epilogue must equal it


def _packed(n, k, gs, seed):
    g = torch.Generator().manual_seed(seed)
    return quantize_linear_weight_int8(torch.randn(n, k, generator=g), gs)


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 10), k=st.integers(1, 200), panels=st.integers(1, 6), gs=st.sampled_from([-1, 8, 32]),
       bias=st.booleans(), batched=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_fused_silu_mul_equals_the_two_ops_bit_for_bit(m, k, panels, gs, bias, batched, dtype, seed):
    """M = 1..4: gate and up panels as pairs of lock-step streams (odd pair counts leave a pair of two streams);
    M > 4: the two ops in one call. Per-group scales need the group to divide K."""
    if gs > 0 and k % gs:
        k = gs * max(1, k // gs)
    n = 64 * panels  # 2H, H a multiple of 32
    q, s = _packed(n, k, gs, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*((2, m, k) if batched else (m, k)), generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    y = linear_w8(x, q, s, b, n, gs)
    want = torch.ops.fxc.silu_mul.default(y[..., : n // 2], y[..., n // 2:])
    out = linear_w8_silu_mul(x, q, s, b, n, gs)
    assert out.dtype == dtype and out.shape == x.shape[:-1] + (n // 2,)
    assert torch.equal(out, want), (out.float() - want.float()).abs().max()
    assert torch.equal(linear_w8_silu_mul_reference(x, q, s, b, n, gs), want)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    aten = linear_w8_silu_mul_aten(x, q, s, b, n, gs)
    assert torch.allclose(out.float(), aten.float(), rtol=tol, atol=tol * max(1.0, aten.abs().max().item()))


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 20), k=st.integers(1, 200), n=st.integers(1, 100), gs=st.sampled_from([-1, 8, 32]),
       bias=st.booleans(), batched=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_fused_add_equals_the_two_ops_bit_for_bit(m, k, n, gs, bias, batched, dtype, seed):
    """Every path (decode streams, row blocks, the int8 scratch panels, AMX from 8 rows where the CPU has it):
    bf16 rounds the linear's output before the sum, as the two ops do; odd N (a masked tail)."""
    if gs > 0 and k % gs:
        k = gs * max(1, k // gs)
    q, s = _packed(n, k, gs, seed)
    g = torch.Generator().manual_seed(seed + 1)
    shape = (2, m, k) if batched else (m, k)
    x = torch.randn(*shape, generator=g).to(dtype)
    r = torch.randn(*shape[:-1], n, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    want = r + linear_w8(x, q, s, b, n, gs)
    out = linear_w8_add(x, q, s, b, r, n, gs)
    assert out.dtype == dtype and out.shape == r.shape
    assert torch.equal(out, want), (out.float() - want.float()).abs().max()
    assert torch.equal(linear_w8_add_aten(x, q, s, b, r, n, gs), r + linear_w8_reference(x, q, s, b, n, gs))


def test_fused_add_names_a_misshapen_residual():
    q, s = _packed(20, 32, -1, 0)
    with pytest.raises(RuntimeError, match=r"fxc::linear_w8_add: residual must be Float \[2, 20\]"):
        linear_w8_add(torch.randn(2, 32), q, s, None, torch.randn(2, 21), 20, -1)
    with pytest.raises(RuntimeError, match="residual must be Float"):
        linear_w8_add(torch.randn(2, 32), q, s, None, torch.randn(2, 20).bfloat16(), 20, -1)


def test_fused_silu_mul_rejects_a_width_off_the_panels():
    q, s = _packed(96, 32, -1, 0)
    with pytest.raises(RuntimeError, match="must be 2 \\* H with H a multiple of 32"):
        linear_w8_silu_mul(torch.randn(1, 32), q, s, None, 96, -1)
    with pytest.raises(ValueError, match="n = 2 \\* H with H a multiple of 32"):
        linear_w8_silu_mul_reference(torch.randn(1, 32), q, s, None, 96, -1)


def test_fused_ops_have_cpu_kernels():
    """The C++ libraries register the ops (not the composite reference compared with itself)."""
    for op in ("fxc::linear_w8_silu_mul", "fxc::linear_w8_add", "fxc::linear_w4_silu_mul", "fxc::linear_w4_add",
               "fxc::linear_add", "fxc::linear_by_m_add"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU"), op


# -- fxc::linear_add / fxc::linear_by_m_add (float32 / bfloat16 weights) --------------------------------------------
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 80), k=st.integers(1, 160), n=st.integers(1, 100), bias=st.booleans(), batched=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), wdtype=st.sampled_from([torch.float32, torch.bfloat16]),
       fxc_m=st.sampled_from([[0, 4], [5, -1], [2, 3, 9, 20], [], [0, -1]]), seed=st.integers(0, 2**16))
def test_float_fused_add_equals_the_two_ops_bit_for_bit(m, k, n, bias, batched, dtype, wdtype, fxc_m, seed):
    """fp32 and bf16 packed weights, fp32 and bf16 x, on every path this process runs (the FMA streams and row
    blocks, VDPBF16PS and AMX from their row thresholds; test_isa_paths reruns this on the lower paths): the
    residual is added in the output loop as ``residual + linear`` adds it (bf16: after rounding the linear's
    output), odd N and K. fxc::linear_by_m_add: fxc::linear_add inside its M ranges, the ATen op and an add
    outside."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    wp = pack_linear_weight(w, wdtype)
    shape = (2, m, k) if batched else (m, k)
    x = torch.randn(*shape, generator=g).to(dtype)
    r = torch.randn(*shape[:-1], n, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = r + linear(x, wp, b, n)
    out = linear_add(x, wp, b, r, n)
    assert out.dtype == dtype and out.shape == r.shape
    assert torch.equal(out, want), (out.float() - want.float()).abs().max()
    assert torch.equal(linear_add_reference(x, wp, b, r, n), want)
    tol = 1e-4 if dtype == torch.float32 and wdtype == torch.float32 else 3e-2
    aten = linear_add_aten(x, wp, b, r, n)
    assert torch.allclose(out.float(), aten.float(), rtol=tol, atol=tol * max(1.0, aten.abs().max().item()))
    for kn in (True, False):
        dense = (w.t().contiguous() if kn else w).to(dtype)
        want = r + linear_by_m(x, wp, dense, kn, b, n, fxc_m)
        assert torch.equal(linear_by_m_add(x, wp, dense, kn, b, r, n, fxc_m), want)
        assert torch.equal(linear_by_m_add_reference(x, wp, dense, kn, b, r, n, fxc_m), want)
        assert torch.equal(linear_by_m_add_dense(x, wp, dense, kn, b, r, n, fxc_m),
                           r + linear_by_m_dense(x, wp, dense, kn, b, n, fxc_m))


def test_float_fused_add_names_a_misshapen_residual():
    wp = pack_linear_weight(torch.randn(20, 32))
    with pytest.raises(RuntimeError, match=r"fxc::linear_add: residual must be Float \[2, 20\]"):
        linear_add(torch.randn(2, 32), wp, None, torch.randn(2, 21), 20)
    with pytest.raises(RuntimeError, match="fxc::linear_add: residual must be Float"):
        linear_add(torch.randn(2, 32), wp, None, torch.randn(2, 20).bfloat16(), 20)
    dense = torch.randn(32, 20)
    for fxc_m in ([0, -1], []):  # the kernel's check and the ATen side's
        with pytest.raises(RuntimeError, match=r"fxc::linear_by_m_add: residual must be Float \[3, 20\]"):
            linear_by_m_add(torch.randn(3, 32), wp, dense, True, None, torch.randn(3, 19), 20, fxc_m)


# -- W4 (fxc::linear_w4: int4 codes, a scale and a min per group) --------------------------------------------------
def _packed4(n, k, gs, seed, half):
    from fxcompiler.ops.quant_linear import pack_int4, quantize_linear_weight_int4, unpack_int4

    g = torch.Generator().manual_seed(seed)
    packed = quantize_linear_weight_int4(torch.randn(n, k, generator=g), gs)
    if not half:
        return packed
    q, s, m = unpack_int4(*packed, n)  # GGUF-like fp16 scales and mins, kept in 2 bytes
    return pack_int4(q, s.half().float(), m.half().float(), gs, compact=True)


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 6), k2=st.integers(1, 100), panels=st.integers(1, 6), gs=st.sampled_from([8, 32, 64]),
       bias=st.booleans(), batched=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       half=st.booleans(), seed=st.integers(0, 2**16))
def test_w4_fused_silu_mul_equals_the_two_ops_bit_for_bit(m, k2, panels, gs, bias, batched, dtype, half, seed):
    """M = 1, 2: gate and up panels as pairs of lock-step streams; more rows: the two ops in one call. K need not be a
    multiple of the group (a short last group)."""
    from fxcompiler.ops.quant_linear import (linear_w4, linear_w4_silu_mul, linear_w4_silu_mul_aten,
                                             linear_w4_silu_mul_reference)

    k, n = 2 * k2, 64 * panels
    packed = _packed4(n, k, gs, seed, half)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*((2, m, k) if batched else (m, k)), generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    y = linear_w4(x, *packed, b, n, gs)
    want = torch.ops.fxc.silu_mul.default(y[..., : n // 2], y[..., n // 2:])
    out = linear_w4_silu_mul(x, *packed, b, n, gs)
    assert out.dtype == dtype and out.shape == x.shape[:-1] + (n // 2,)
    assert torch.equal(out, want), (out.float() - want.float()).abs().max()
    assert torch.equal(linear_w4_silu_mul_reference(x, *packed, b, n, gs), want)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    aten = linear_w4_silu_mul_aten(x, *packed, b, n, gs)
    assert torch.allclose(out.float(), aten.float(), rtol=tol, atol=tol * max(1.0, aten.abs().max().item()))


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 9), k2=st.integers(1, 100), n=st.integers(1, 100), gs=st.sampled_from([8, 32, 64]),
       bias=st.booleans(), batched=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       half=st.booleans(), seed=st.integers(0, 2**16))
def test_w4_fused_add_equals_the_two_ops_bit_for_bit(m, k2, n, gs, bias, batched, dtype, half, seed):
    """Decode streams (M <= 4) and the tile path (M > 4); bf16 rounds the linear's output before the sum."""
    from fxcompiler.ops.quant_linear import linear_w4, linear_w4_add, linear_w4_add_aten, linear_w4_reference

    k = 2 * k2
    packed = _packed4(n, k, gs, seed, half)
    g = torch.Generator().manual_seed(seed + 1)
    shape = (2, m, k) if batched else (m, k)
    x = torch.randn(*shape, generator=g).to(dtype)
    r = torch.randn(*shape[:-1], n, generator=g).to(dtype)
    b = torch.randn(n, generator=g) if bias else None
    want = r + linear_w4(x, *packed, b, n, gs)
    out = linear_w4_add(x, *packed, b, r, n, gs)
    assert out.dtype == dtype and out.shape == r.shape
    assert torch.equal(out, want), (out.float() - want.float()).abs().max()
    assert torch.equal(linear_w4_add_aten(x, *packed, b, r, n, gs), r + linear_w4_reference(x, *packed, b, n, gs))


def test_w4_fused_ops_name_bad_input():
    from fxcompiler.ops.quant_linear import linear_w4_add, linear_w4_silu_mul, linear_w4_silu_mul_reference

    packed = _packed4(96, 32, 8, 0, False)
    with pytest.raises(RuntimeError, match=r"fxc::linear_w4_add: residual must be Float \[2, 96\]"):
        linear_w4_add(torch.randn(2, 32), *packed, None, torch.randn(2, 95), 96, 8)
    with pytest.raises(RuntimeError, match="fxc::linear_w4_silu_mul: n=96 must be 2 \\* H with H a multiple of 32"):
        linear_w4_silu_mul(torch.randn(1, 32), *packed, None, 96, 8)
    with pytest.raises(ValueError, match="fxc::linear_w4_silu_mul needs n = 2 \\* H"):
        linear_w4_silu_mul_reference(torch.randn(1, 32), *packed, None, 96, 8)
