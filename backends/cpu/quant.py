"""CPU kernels of the quantized-weight ops (``fxc::linear_w4``, ``fxc::linear_f8``, ``fxc::linear_f8f8``, and the
quantized-table lookups ``fxc::embedding_w8`` / ``fxc::embedding_w4``), from ``csrc/quant_kernels.cpp``.

Built on first use through :func:`backends.cpu._build.load_extension` into its own cache entry (so
it never rebuilds the main kernel library), with ``-ffp-contract=off`` so that the dequantised tile
equals the reference's values bit for bit. Importing this module installs the lazy loader on the op
(:func:`fxcompiler.ops.quant_linear.set_quant_kernel_loader`); without a compiler or AVX2 the ATen
reference runs (one warning). ``fxc::linear_w8``'s kernel lives in the main library (``_ops``).
"""
from __future__ import annotations

import threading

from fxcompiler.ops import quant_linear as _ops

from . import _build

_SOURCE = _build._CSRC / "quant_kernels.cpp"
_state: dict = {"tried": False, "module": None, "error": None}
_lock = threading.Lock()


def _load() -> str:
    return _build.load_op_library("fxc_quant", _SOURCE, ["-ffp-contract=off"])


def ensure_loaded() -> bool:
    """Build/load the quantized kernels once per process; True when they are active."""
    return _build.load_once(_state, _lock, _load,
                            "fxcompiler quantized CPU kernels unavailable; fxc::linear_w4 and fxc::linear_f8 run their ATen references") \
        is not None


def isa() -> str:
    return _state["module"] if ensure_loaded() else "aten"


_ops.set_quant_kernel_loader(ensure_loaded)
