"""CPU kernel of ``fxc::moe``'s experts for a few tokens, from ``csrc/moe_kernels.cpp``.

Built on first use through :func:`backends.cpu._build.load_extension` into its own cache entry (it never
rebuilds the main kernel library). Importing this module installs the loader on the op
(:func:`fxcompiler.ops.moe.set_moe_kernel_loader`): ``moe_cpu`` then runs the C++ experts (after the ATen
router and top-k) for up to ``MAX_TOKENS`` tokens and its grouped-matmul ATen path above that, or always
without a compiler / AVX2 (one warning).
"""
from __future__ import annotations

import importlib
import threading

from . import _build

# the module, not the op that fxcompiler.ops re-exports under the same name
_ops = importlib.import_module("fxcompiler.ops.moe")

# Token counts up to this run the C++ kernel; measured on Intel Xeon family 6 model 167 (benchmarks/moe.py).
MAX_TOKENS = 16

_SOURCE = _build._CSRC / "moe_kernels.cpp"
_state: dict = {"tried": False, "module": None, "error": None}
_lock = threading.Lock()


def _load() -> str:
    return _build.load_op_library("fxc_moe", _SOURCE, ())


def ensure_loaded() -> bool:
    """Build/load the MoE kernel once per process; True when it is active."""
    return _build.load_once(_state, _lock, _load,
                            "fxcompiler MoE CPU kernel unavailable; fxc::moe runs its ATen CPU path") is not None


def isa() -> str:
    return _state["module"] if ensure_loaded() else "aten"


_ops.set_moe_kernel_loader(ensure_loaded, MAX_TOKENS)
