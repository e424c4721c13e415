"""fxcompiler CPU kernel library: weight-streaming linear ops usable as single torch.export nodes.

* ``fxc::linear(Tensor x, Tensor w_packed, Tensor? bias, int n) -> Tensor``: fp32 / bf16 weights packed by
  :func:`pack_linear_weight` (``[P, K, 32]`` fp32, ``[P, ceil(K/2), 32, 2]`` bf16), x fp32 or bf16, fp32 accumulation.
* ``fxc::linear_w8(Tensor x, Tensor w_int8_packed, Tensor scales, Tensor? bias, int n, int group_size) -> Tensor``:
  int8 weight-only, per-channel (group_size -1 or K) or per-group scales, from :func:`quantize_linear_weight_int8`.

The schemas, fake kernels, ATen references and packing functions are IR-level (``fxcompiler/ops/linear.py``, so a
lowering pass can prepack without importing a backend) and re-exported here; this package holds the C++ kernels
(AVX-512 / AVX2, AMX tiles for bf16/int8 at M >= 8), built on first use (without a compiler the ops fall back to
ATen with one warning), and the build-time autotuner (``autotune.LinearAutotuner``) that ``passes/lower_cpu_kernels``
asks whether the kernel wins per shape.  Details, layouts and the measurements behind the design: ``README.md``.

Measured at M = 1, 2 threads, weights streamed from DRAM (512 MiB pool per candidate), median GB/s of weight bytes on
the dev VM (Intel Xeon + AMX, DRAM read ceiling 28.5 GB/s; noisy shared host, best calls in the README):

    K->N        fp32 fxc | best torch          bf16 fxc(x fp32/bf16) | best torch     int8 fxc ch/g64 | int8pack_mm
    576->1536     20.6   | 20.2 mm(W^T)          22.3 / 20.7         |  8.9 oneDNN       18.2 / 18.8    |  7.6
    1536->576     20.6   | 18.7 mm(W^T)          22.1 / 25.1         | 15.5 oneDNN       19.1 / 19.8    |  7.6
    576->576      20.8   | 20.2 mm(W^T)          16.6 / 19.1         |  7.0 F.linear     11.8 / 12.9    |  6.4
    576->192      13.7   | 14.8 F.linear         10.7 / 10.6         |  4.8 F.linear      8.4 /  6.8    |  3.9
    576->49152    24.5   | 25.7 mkl packed       23.0 / 27.1         | 10.3 F.linear     20.2 / 18.8    |  9.7

Candidates measured: ``torch.mm`` with a pre-transposed [K, N] weight, ``F.linear``, the MKL / oneDNN prepacked linears
that inductor freezing uses (``mkl._mkl_linear``, ``mkldnn._linear_pointwise``) and ``aten._weight_int8pack_mm``.
fp32: fxc ties the best torch candidate (all at the DRAM ceiling); bf16 and int8: fxc wins by 2-3x.  So every call
runs the fxc kernel (one weight copy, no per-shape dispatch).
"""

from __future__ import annotations

import torch

from . import _build, _ops, moe, quant, w8a8  # noqa: F401  (_ops: the fxc:: operators; quant: fxc::linear_w4, linear_f8; w8a8: fxc::linear_w8a8; moe: fxc::moe)
from ._ops import linear_aten, linear_w8_aten
from .packing import (
    NB,
    dequantize_linear_weight_int8,
    pack_linear_weight,
    quantize_linear_weight_int8,
    unpack_linear_weight,
)

__all__ = [
    "NB",
    "dequantize_linear_weight_int8",
    "isa",
    "kernels_available",
    "linear",
    "linear_aten",
    "linear_w8",
    "linear_w8_aten",
    "pack_linear_weight",
    "quantize_linear_weight_int8",
    "unpack_linear_weight",
]


def kernels_available() -> bool:
    """True when the C++ kernels are built and loaded (builds them on first call)."""
    return _build.ensure_loaded()


def isa() -> str:
    """The ISA the fxc ops run with: 'avx512+amx', 'avx512+bf16dot', 'avx512', 'avx2' or 'aten' (fallback).
    Builds on first call.

    '+amx': bf16/int8 weights with M >= 8 rows use AMX tiles (set FXCOMPILER_CPU_AMX=0 to disable).
    '+bf16dot': no AMX, but bf16 weights with bf16 x and M >= 5 rows use AVX-512-BF16 dot products
    (set FXCOMPILER_CPU_BF16DOT=0 to disable).
    """
    if not _build.ensure_loaded():
        return "aten"
    st = _build.state()
    return st["isa"] + _build.isa_suffix(st)


def linear(x: torch.Tensor, w_packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    return torch.ops.fxc.linear.default(x, w_packed, bias, n)


def linear_w8(x: torch.Tensor, w_int8_packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
              n: int, group_size: int = -1) -> torch.Tensor:
    return torch.ops.fxc.linear_w8.default(x, w_int8_packed, scales, bias, n, group_size)
