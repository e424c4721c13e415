"""fxcompiler CPU kernel library (placeholder docstring, filled in after measurements)."""

from __future__ import annotations

import torch

from . import _build, _ops  # noqa: F401  (_ops defines the fxc:: operators)
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
    """The ISA the fxc ops run with: 'avx512+amx', 'avx512', 'avx2' or 'aten' (fallback). Builds on first call.

    '+amx': bf16/int8 weights with M >= 8 rows use AMX tiles (set FXCOMPILER_CPU_AMX=0 to disable).
    """
    if not _build.ensure_loaded():
        return "aten"
    st = _build.state()
    return st["isa"] + ("+amx" if st["amx"] else "")


def linear(x: torch.Tensor, w_packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    return torch.ops.fxc.linear.default(x, w_packed, bias, n)


def linear_w8(x: torch.Tensor, w_int8_packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
              n: int, group_size: int = -1) -> torch.Tensor:
    return torch.ops.fxc.linear_w8.default(x, w_int8_packed, scales, bias, n, group_size)
