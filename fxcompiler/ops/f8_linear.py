"""``fxc::linear_f8f8``: fp8 e4m3 activations x fp8 e4m3 weights (furiosa's ``w_f8_a_f8``, ``Wf8Af8``).

The weights are ``fxc::linear_f8``'s: e4m3 codes ``q [N, K]`` with one fp32 scale per output channel
(``w = s·q``), packed ``float8_e4m3fn [P, K, 32]``. Each call quantizes its input per token (row), dynamically,
as vLLM's ``scaled_fp8_quant`` does for fp8 activations:

    amax_r = max_k |x[r, k]|,  x_scale_r = amax_r / 448  (1 for a zero row)
    qx[r, k] = e4m3(clamp(x[r, k] / x_scale_r, -448, 448))   (round to nearest even: torch's cast)
    out[r, n] = fl(fl(w_scale[n] · Σ_k qx[r, k]·q[n, k]) · x_scale_r) (+ bias[n]), in x's dtype

CPUs have no fp8 arithmetic: the e4m3 values are upcast to fp32 (exactly) and multiplied there. A product of
two e4m3 values has at most 8 significant bits, so every product is exact in fp32 and the only rounding is
the fp32 accumulation: what an fp8 GEMM with fp32 accumulation and a per-token x per-channel scale epilogue
computes, up to summation order. On CPU the op is one C++ kernel (``backends/cpu/csrc/quant_kernels.cpp``,
loaded with ``fxc::linear_f8``'s): it quantizes the rows exactly as :func:`quantize_rows_e4m3` does (same
bits) and runs ``fxc::linear_f8``'s matmul on them with the row scales in its epilogue, so its output equals
:func:`linear_f8f8_composite` (the row quantization in ATen around ``fxc::linear_f8``) bit for bit. Without
the kernel library the composite runs.
"""
from __future__ import annotations

import torch

from .quant_linear import FP8, FP8_MAX, _composite_of, _lib, linear_f8_reference

__all__ = ["linear_f8f8", "linear_f8f8_reference", "quantize_rows_e4m3"]

_lib.define("linear_f8f8(Tensor x, Tensor w_f8_packed, Tensor scales, Tensor? bias, int n) -> Tensor")


def quantize_rows_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qx, x_scale)``: the e4m3 values of ``x``'s rows on their per-row grids, as fp32 (exact), and the fp32
    scales ``[..., 1]`` (``amax / 448``, 1 for a zero row)."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1, keepdim=True) if xf.shape[-1] else xf.new_zeros(*xf.shape[:-1], 1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8).to(torch.float32), scale


def _linear_f8f8(x, w_f8_packed, scales, bias, n, matmul):
    if w_f8_packed.dim() != 3 or w_f8_packed.shape[1] != x.shape[-1]:
        raise ValueError(f"fxc::linear_f8f8: K mismatch: x has K={x.shape[-1]}, the packed weight is "
                         f"{tuple(w_f8_packed.shape)} ([P, K, 32])")
    qx, xs = quantize_rows_e4m3(x)
    out = matmul(qx, w_f8_packed, scales, None, n) * xs
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


def linear_f8f8_reference(x, w_f8_packed, scales, bias, n):
    """ATen implementation: the rows quantized as above, then ``fxc::linear_f8``'s reference (upcast weight,
    fp32 ``F.linear``), then the row scales."""
    return _linear_f8f8(x, w_f8_packed, scales, bias, n, linear_f8_reference)


def linear_f8f8_composite(x, w_f8_packed, scales, bias, n):
    """The row quantization in ATen and the matmul through ``fxc::linear_f8`` (its C++ kernel on CPU): what runs
    without the C++ ``linear_f8f8`` kernel (which equals it bit for bit), and what ``edf`` inlines off CPU."""
    return _linear_f8f8(x, w_f8_packed, scales, bias, n, torch.ops.fxc.linear_f8.default)


@torch.library.register_fake("fxc::linear_f8f8", lib=_lib)
def _linear_f8f8_fake(x, w_f8_packed, scales, bias, n):
    torch._check(x.dtype in (torch.float32, torch.bfloat16), lambda: f"fxc::linear_f8f8: x dtype {x.dtype}")
    torch._check(w_f8_packed.dtype == FP8 and w_f8_packed.dim() == 3 and w_f8_packed.shape[1] == x.shape[-1],
                 lambda: f"fxc::linear_f8f8: packed weight must be float8_e4m3fn [P, K={x.shape[-1]}, 32], got "
                         f"{w_f8_packed.dtype} {tuple(w_f8_packed.shape)}")
    return x.new_empty(tuple(x.shape[:-1]) + (n,))


# the C++ kernel once the quantized-kernel library loads (backends/cpu/quant.py), else the composite
_lib.impl("linear_f8f8", _composite_of(torch.ops.fxc.linear_f8f8.default, linear_f8f8_composite),
          "CompositeExplicitAutograd")
linear_f8f8 = torch.ops.fxc.linear_f8f8.default
