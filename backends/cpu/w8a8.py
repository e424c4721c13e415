"""CPU kernels of ``fxc::linear_w8a8`` (W8A8) and ``fxc::linear_w4a8`` (W4A8), from ``csrc/w8a8_kernels.cpp``.

Built on first use into its own cache entry (:func:`backends.cpu._build.load_op_library`) with
``-ffp-contract=off`` (the rescale is the reference's multiply, multiply, add). The kernel picks its
inner loop from CPUID at run time (AVX-512 VNNI, AVX-VNNI, AVX2 ``vpmaddubsw``, scalar); :func:`path`
reads it and :func:`set_path` caps it (tests run every path this CPU has; ``FXCOMPILER_W8A8_PATH`` does
the same at load). Importing this module installs the lazy loader on the op; without a compiler the ATen
reference runs (one warning).
"""
from __future__ import annotations

import threading

import torch

from fxcompiler.ops import w4a8_linear as _w4a8_ops
from fxcompiler.ops import w8a8_linear as _ops

from . import _build

_SOURCE = _build._CSRC / "w8a8_kernels.cpp"
_state: dict = {"tried": False, "module": None, "error": None}
_lock = threading.Lock()
PATHS = ("scalar", "avx2", "avxvnni", "avx512vnni")


def _load() -> str:
    return _build.load_op_library("fxc_w8a8", _SOURCE, ["-ffp-contract=off"])


def ensure_loaded() -> bool:
    """Build/load the W8A8 kernel once per process; True when it is active."""
    return _build.load_once(_state, _lock, _load,
                            "fxcompiler W8A8/W4A8 CPU kernel unavailable; fxc::linear_w8a8 and fxc::linear_w4a8 run their ATen references") \
        is not None


def path() -> str:
    """The kernel's inner loop in use (``aten`` when the kernel is not built)."""
    return PATHS[torch.ops.fxc._w8a8_path(-1)] if ensure_loaded() else "aten"


def set_path(name: str) -> str:
    """Use ``name`` (one of :data:`PATHS`), or the best this CPU has below it; returns the path now in use."""
    if name not in PATHS:
        raise ValueError(f"W8A8 kernel path must be one of {PATHS}, got {name!r}")
    if not ensure_loaded():
        return "aten"
    return PATHS[torch.ops.fxc._w8a8_path(PATHS.index(name))]


def available_paths() -> list[str]:
    """The paths this CPU runs, best first (the kernel's own CPUID check)."""
    if not ensure_loaded():
        return []
    current = torch.ops.fxc._w8a8_path(-1)
    out = [PATHS[i] for i in range(len(PATHS) - 1, -1, -1) if torch.ops.fxc._w8a8_path(i) == i]
    torch.ops.fxc._w8a8_path(current)
    return out


_ops.set_w8a8_kernel_loader(ensure_loaded)
_w4a8_ops.set_w4a8_kernel_loader(ensure_loaded)
