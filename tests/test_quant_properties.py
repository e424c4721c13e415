"""Property tests (hypothesis): the packers/unpackers of the quantized layouts against an independent
reference dequantiser, and the qparam/qformat file round trips.

Error bounds (docs/quantization.md): RTN int8 ≤ scale/2 per value; RTN int4 asymmetric ≤ scale/2;
RTN fp8 (e4m3) ≤ max(|w|/16, scale/1024); given codes and scales, every layout dequantises bit-exactly to
``s·q`` (int8, fp8) or ``fl(fl(s·q) + m)`` (int4).
"""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxcompiler.ops.linear import dequantize_linear_weight_int8, quantize_linear_weight_int8
from fxcompiler.ops.quant_linear import dequantize_linear_weight_int4, quantize_linear_weight_int4, unpack_int4
from fxcompiler.qformat import ModuleScheme, load_qformat, write_qformat
from fxcompiler.qparam import QParamSet, save_qparam
from fxcompiler.quant_config import QuantizationConfig


def _ref_int8(w: torch.Tensor, gs: int) -> torch.Tensor:
    """Symmetric int8 RTN dequantised, written independently of the packer."""
    n, k = w.shape
    g = 1 if gs == -1 else k // gs
    wg = w.reshape(n, g, k // g).double()
    amax = wg.abs().amax(2, keepdim=True)
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).float().double()
    # w / s in fp32, as the packer divides: in double a value a hair off a .5 tie can round the other way
    q = torch.clamp(torch.round((wg.float() / s.float()).double()), -127, 127)
    return (q * s).reshape(n, k)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 70), k=st.sampled_from([32, 64, 96]), gs=st.sampled_from([-1, 32]), seed=st.integers(0, 2**16))
def test_int8_packer_dequantises_to_reference(n, k, gs, seed):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    packed, scales = quantize_linear_weight_int8(w, gs)
    dq = dequantize_linear_weight_int8(packed, scales, n, gs).double()
    ref = _ref_int8(w, gs)
    torch.testing.assert_close(dq, ref, rtol=0, atol=1e-6)  # float32 scale products vs double
    g = 1 if gs == -1 else k // gs
    step = w.reshape(n, g, -1).abs().amax(2).repeat_interleave(k // g, 1) / 127
    assert ((dq - w.double()).abs() <= step.double() / 2 + 1e-6).all()


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 40), groups=st.integers(1, 3), gs=st.sampled_from([32, 64]), sym=st.booleans(),
       seed=st.integers(0, 2**16))
def test_qparam_scales_reproduce_rtn_int4_codes(n, groups, gs, sym, seed, tmp_path_factory):
    """Rounding a weight onto qparam scales/mins equals the pass's own RTN packer, code for code."""
    k = groups * gs
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    packed, s, m = quantize_linear_weight_int4(w, gs, sym)
    q_ref, s_ref, m_ref = unpack_int4(packed, s, m, n)
    tensors = {"mod.weight_scale": s_ref}
    if not sym:
        tensors["mod.weight_min"] = m_ref
    path = tmp_path_factory.mktemp("qp") / "qparam.safetensors"
    save_qparam(path, tensors)
    codes, scales, mins = QParamSet(path).codes_for(["mod"], w, "int4", gs, sym)
    assert torch.equal(scales, s_ref) and torch.equal(mins, m_ref)
    got = codes.float() * scales.repeat_interleave(gs, 1) + mins.repeat_interleave(gs, 1)
    if sym:  # RTN rounds w/s + 8, the qparam path (w + 8s)/s: at most one code apart, at float ties
        assert (codes.to(torch.int16) - q_ref.to(torch.int16)).abs().max() <= 1
    else:
        assert torch.equal(codes, q_ref)
        assert torch.equal(got, dequantize_linear_weight_int4(packed, s, m, n, gs))
    step = s_ref.abs().repeat_interleave(gs, 1)
    assert ((got - w).abs() <= step * (1.0 if sym else 0.5) + 1e-6).all()


def _ref_fp8(w: torch.Tensor) -> torch.Tensor:
    """e4m3 RTN dequantised, written independently of the packer: the nearest of the 253 finite e4m3 values
    (ties to the even code) of w / s, s = amax / 448 per row."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    codes = torch.arange(256)
    keep = torch.isfinite(grid) & ~((grid == 0) & (codes >= 128))  # drop NaN and -0
    grid, codes = grid[keep], codes[keep]
    amax = w.abs().amax(1, keepdim=True).double()
    s = torch.where(amax > 0, (amax.float() / 448).double(), torch.ones_like(amax))
    v = (w.double() / s).float().double()  # the packer divides in fp32
    d = (v[..., None] - grid).abs()
    best = d.min(-1, keepdim=True).values
    tie_even = torch.where(d == best, (codes % 2 == 0).double() + 1, torch.zeros_like(d))  # prefer the even code
    return grid[tie_even.argmax(-1)] * s


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 96), scale=st.floats(1e-4, 1e2), seed=st.integers(0, 2**16))
def test_fp8_packer_dequantises_to_reference(n, k, scale, seed, tmp_path_factory):
    """The fp8 packer equals an independent nearest-e4m3 rounding, and rounding onto qparam scales alone gives
    the packer's codes, code for code."""
    from fxcompiler.ops.quant_linear import dequantize_linear_weight_fp8, quantize_fp8_codes, quantize_linear_weight_fp8

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * scale
    packed, scales = quantize_linear_weight_fp8(w)
    dq = dequantize_linear_weight_fp8(packed, scales, n).double()
    torch.testing.assert_close(dq, _ref_fp8(w), rtol=1e-7, atol=0)  # fp32 scale product vs double
    q, s = quantize_fp8_codes(w)
    path = tmp_path_factory.mktemp("qp") / "qparam.safetensors"
    save_qparam(path, {"mod.weight_scale": s})
    codes, got_s, mins = QParamSet(path).codes_for(["mod"], w, "fp8", -1, True)
    assert mins is None and torch.equal(got_s, s) and torch.equal(codes.view(torch.uint8), q.view(torch.uint8))


_schemes = st.one_of(st.just(ModuleScheme("keep")),
                     st.builds(ModuleScheme, st.just("int8"), st.sampled_from([-1, 32, 64]), st.just(True)),
                     st.just(ModuleScheme("fp8", -1, True)),
                     st.builds(ModuleScheme, st.just("int4"), st.sampled_from([32, 64, 128]), st.booleans()))


@settings(max_examples=25, deadline=None)
@given(default=_schemes, modules=st.dictionaries(st.from_regex(r"model\.layers\.[0-9*]\.(mlp|self_attn)\.[a-z_*]{1,8}",
                                                               fullmatch=True), _schemes, max_size=4),
       weight=st.sampled_from(["int8", "int4", "fp8"]))
def test_qformat_write_load_round_trip(default, modules, weight, tmp_path_factory):
    path = tmp_path_factory.mktemp("qf") / "qformat.yaml"
    cfg = QuantizationConfig(weight, "bf16")
    write_qformat(path, cfg, default, modules)
    qf = load_qformat(path)
    assert qf.default == default and dict(qf.modules) == modules
    assert (qf.config.weight, qf.config.activation) == (cfg.weight, cfg.activation)
