"""Property tests of ``fxc::linear``'s AVX-512-BF16 path (VDPBF16PS: bf16 weights, bf16 activations, M >= 5
rows, CPUs without AMX or with ``FXCOMPILER_CPU_AMX=0``) against float64 ATen, and against the FMA path it
replaces (switched in-process with ``_build.set_bf16dot``).

Tolerance (as ``test_kernels._check``): the products of two bf16 numbers are exact in fp32, the sums are
fp32 in another order than the reference, so ``|y - ref| <= 1e-4 * sum_k |x_k w_k| + 2^-8 |ref|`` (the last
term: the bf16 output's rounding). On machines without the path the tests check the path that runs instead
(the FMA or AMX kernels) with the same bound; ``test_bf16dot_is_selected`` says whether it was the new one.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import backends.cpu as fxc
from backends.cpu import _build

from .test_kernels import _check, _rand

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512_bf16" in line for line in f)
    except OSError:
        return False


@pytest.fixture(scope="module", autouse=True)
def _built():
    fxc.kernels_available()
    yield
    if _build.state().get("lib") is not None:  # leave the process-wide switch as the environment set it
        import os
        _build.set_bf16dot(os.environ.get("FXCOMPILER_CPU_BF16DOT", "") != "0")


def test_bf16dot_is_selected():
    """On an AVX-512 build without AMX, a CPU with AVX512_BF16 runs the path unless FXCOMPILER_CPU_BF16DOT=0."""
    import os
    if not fxc.kernels_available() or _build.state()["isa"] != "avx512" or _build.state()["amx"]:
        pytest.skip(f"the VDPBF16PS path is used by AVX-512 builds without AMX (here: {fxc.isa()})")
    want = _cpu_has_avx512_bf16() and os.environ.get("FXCOMPILER_CPU_BF16DOT", "") != "0"
    assert fxc.isa() == ("avx512+bf16dot" if want else "avx512")


@st.composite
def problems(draw):
    m = draw(st.one_of(st.integers(5, 40), st.sampled_from([64, 100, 256, 300])))
    k = draw(st.one_of(st.integers(1, 200), st.sampled_from([2, 64, 576, 577, 1536])))
    n = draw(st.one_of(st.integers(1, 130), st.sampled_from([32, 96, 192])))
    return m, k, n, draw(st.integers(0, 2**31 - 1))


@SETTINGS
@given(problems(), st.booleans(), st.sampled_from(["plain", "batched", "odd_offset", "strided"]))
def test_bf16dot_matches_aten(prob, with_bias, layout):
    m, k, n, seed = prob
    w = _rand(n, k, seed=seed)
    x = _rand(m, k, seed=seed + 1, dtype=torch.bfloat16)
    bias = _rand(n, seed=seed + 2) if with_bias else None
    wp = fxc.pack_linear_weight(w, torch.bfloat16)
    if layout == "batched" and m % 2 == 0:
        xin = x.reshape(2, m // 2, k)
    elif layout == "odd_offset":  # data pointer 2 bytes past a 4-byte boundary: x pairs read unaligned
        buf = torch.zeros(m * k + 1, dtype=torch.bfloat16)
        buf[1:] = x.reshape(-1)
        xin = buf[1:].view(m, k)
    elif layout == "strided":
        xin = torch.cat([x, x], dim=1)[:, :k]
    else:
        xin = x
    y = torch.ops.fxc.linear(xin, wp, bias, n).reshape(m, n)
    _check(y, x, w.bfloat16().double(), bias)


@SETTINGS
@given(problems())
def test_bf16dot_agrees_with_fma_path(prob):
    """The new path and the FMA path it replaces compute the same sums up to order and one bf16 rounding."""
    m, k, n, seed = prob
    w, x = _rand(n, k, seed=seed), _rand(m, k, seed=seed + 1, dtype=torch.bfloat16)
    wp = fxc.pack_linear_weight(w, torch.bfloat16)
    on = _build.set_bf16dot(True)
    y_dot = torch.ops.fxc.linear(x, wp, None, n)
    _build.set_bf16dot(False)
    y_fma = torch.ops.fxc.linear(x, wp, None, n)
    _build.set_bf16dot(on)
    absdot = x.double().abs() @ w.bfloat16().double().abs().T
    bound = 2.0**-7 * y_fma.double().abs() + 2e-4 * absdot + 1e-30
    assert ((y_dot.double() - y_fma.double()).abs() <= bound).all()


def test_rows_do_not_depend_on_m_or_blocking():
    """A row's sums depend on its own data only: the first rows of M = 5 ... 300 are bit-identical."""
    k, n = 1536, 96
    w, x = _rand(n, k, seed=1), _rand(300, k, seed=2, dtype=torch.bfloat16)
    wp = fxc.pack_linear_weight(w, torch.bfloat16)
    first = torch.ops.fxc.linear(x[:5], wp, None, n)
    for m in (6, 13, 25, 64, 129, 300):
        assert torch.equal(torch.ops.fxc.linear(x[:m], wp, None, n)[:5], first)


@SETTINGS
@given(problems(), st.booleans(), st.booleans())
def test_bf16dot_w8_per_channel_matches_dequantised_weights_and_the_fma_path(prob, with_bias, with_residual):
    """Per-channel int8 weights (W8A16) take the path too: each panel converted to bf16 pairs (exact), the
    column scales in the output store. Against float64 ATen on the dequantised weights, and against the FMA
    path (the int8 weights widened to fp32) within the same bound as bf16 weights."""
    m, k, n, seed = prob
    w, x = _rand(n, k, seed=seed), _rand(m, k, seed=seed + 1, dtype=torch.bfloat16)
    bias = _rand(n, seed=seed + 2) if with_bias else None
    q, s = fxc.quantize_linear_weight_int8(w, -1)
    wd = fxc.dequantize_linear_weight_int8(q, s, n, -1)
    res = _rand(m, n, seed=seed + 3, dtype=torch.bfloat16) if with_residual else None
    on = _build.set_bf16dot(True)
    try:
        if res is None:
            y_dot = torch.ops.fxc.linear_w8(x, q, s, bias, n, -1)
        else:
            y_dot = torch.ops.fxc.linear_w8_add(x, q, s, bias, res, n, -1)
        _build.set_bf16dot(False)
        if res is None:
            y_fma = torch.ops.fxc.linear_w8(x, q, s, bias, n, -1)
        else:
            y_fma = torch.ops.fxc.linear_w8_add(x, q, s, bias, res, n, -1)
    finally:
        _build.set_bf16dot(on)
    if res is None:
        _check(y_dot, x, wd.double(), bias)
    absdot = x.double().abs() @ wd.double().abs().T + (bias.double().abs() if bias is not None else 0)
    scale = y_fma.double().abs() + (res.double().abs() if res is not None else 0)
    bound = 2.0**-7 * scale + 2e-4 * absdot + 1e-30
    assert ((y_dot.double() - y_fma.double()).abs() <= bound).all()


def test_bf16dot_w8_rows_do_not_depend_on_m():
    k, n = 577, 96  # odd K: the last pair of each converted panel is padded
    w, x = _rand(n, k, seed=3), _rand(129, k, seed=4, dtype=torch.bfloat16)
    q, s = fxc.quantize_linear_weight_int8(w, -1)
    first = torch.ops.fxc.linear_w8(x[:5], q, s, None, n, -1)
    for m in (6, 13, 64, 129):
        assert torch.equal(torch.ops.fxc.linear_w8(x[:m], q, s, None, n, -1)[:5], first)
