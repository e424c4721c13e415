"""Build-time weight packing for the ``fxc`` CPU ops: defined at the IR level in
:mod:`fxcompiler.ops.linear` (passes prepack without importing a backend), re-exported here."""

from __future__ import annotations

from fxcompiler.ops.linear import (  # noqa: F401
    NB,
    _is_per_channel,
    _pad_rows,
    _panels,
    dequantize_linear_weight_int8,
    pack_linear_weight,
    quantize_linear_weight_int8,
    unpack_linear_weight,
)

__all__ = ["NB", "dequantize_linear_weight_int8", "pack_linear_weight", "quantize_linear_weight_int8",
           "unpack_linear_weight"]
