"""CPU kernels for ``fxc::paged_attention`` (decode-shaped calls), ``fxc::rms_norm``,
``fxc::silu_mul`` and ``fxc::rope``, built on first use into one extension module.

Decode is the hot path: one query token per sequence, called once per layer per
step. The ATen reference (gather + SDPA) costs ~15 small ops a call; the C++ kernel
walks the block table in place over the real context. Calls with more query tokens
(prefill) keep the reference, which batches them as one SDPA.
"""
from __future__ import annotations

import hashlib
import os
import threading
import warnings
from pathlib import Path

import torch

from fxcompiler.ops.paged_attention import attend_reference, paged_attention_reference

from . import _build

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = (_CSRC / "paged_attention.cpp", _CSRC / "fused_ops.cpp")
_HEADERS = (_CSRC / "simd_math.h",)
MAX_KERNEL_QUERY_TOKENS = 4  # beyond this, SDPA's blocked kernel wins
_lock = threading.Lock()
_state: dict = {"module": None, "tried": False, "error": None}
_impl_lib = None


def _load():
    from torch.utils import cpp_extension

    isa = _build.detect_isa()
    if isa == "aten":
        raise RuntimeError("no AVX2/AVX-512 on this CPU (or FXCOMPILER_CPU_ISA=aten)")
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"] + _build._FLAGS[isa]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES + _HEADERS) + " ".join(flags).encode()
                            + torch.__version__.encode()).hexdigest()
    name = f"fxc_paged_attention_{isa}_{digest[:12]}"
    build_dir = _build.cache_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", "2")
    return cpp_extension.load(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                              build_directory=str(build_dir), verbose=bool(os.environ.get("FXCOMPILER_VERBOSE_BUILD")))


def kernel_module():
    """The compiled module, or None (with one warning) when it cannot be built here."""
    if _state["tried"]:
        return _state["module"]
    with _lock:
        if not _state["tried"]:
            try:
                _state["module"] = _load()
            except Exception as exc:  # compiler missing, build or load error
                _state["error"] = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"fxc::paged_attention CPU kernel unavailable ({str(exc).splitlines()[0][:200]}); "
                              "using the ATen reference", RuntimeWarning, stacklevel=2)
            finally:
                _state["tried"] = True
    return _state["module"]


def paged_attention_cpu(query, key, value, k_cache, v_cache, block_table, slot_mapping, query_pos, seq_lens,
                        scale, sliding_window=-1, softcap=0.0):
    mod = _state["module"]
    if mod is not None and query.shape[2] <= MAX_KERNEL_QUERY_TOKENS and query.dtype == k_cache.dtype \
            and key.dtype == k_cache.dtype:
        return mod.paged_attention_cpu(query, key, value, k_cache, v_cache, block_table, slot_mapping, query_pos,
                                       seq_lens, scale, sliding_window, softcap)
    if mod is not None and key.dtype == k_cache.dtype:
        # Prefill: the C++ cache write (ATen's index_copy_ is slow with many rows), then SDPA.
        mod.write_cache(key, value, k_cache, v_cache, slot_mapping)
        return attend_reference(query, k_cache, v_cache, block_table, query_pos, seq_lens, scale, sliding_window,
                                softcap)
    return paged_attention_reference(query, key, value, k_cache, v_cache, block_table, slot_mapping, query_pos,
                                     seq_lens, scale, sliding_window, softcap)


def install() -> bool:
    """Route CPU calls of ``fxc::paged_attention`` to the kernel; True when the kernel is active."""
    global _impl_lib
    if kernel_module() is None:
        return False
    with _lock:
        if _impl_lib is None:
            import fxcompiler.ops.fused  # noqa: F401  (defines the fused ops before we implement them)

            mod = _state["module"]
            _impl_lib = torch.library.Library("fxc", "IMPL")
            _impl_lib.impl("paged_attention", paged_attention_cpu, "CPU")
            _impl_lib.impl("rms_norm", mod.rms_norm, "CPU")
            _impl_lib.impl("silu_mul", mod.silu_mul, "CPU")
            _impl_lib.impl("rope", mod.rope, "CPU")
    return True
