"""CPU kernels for ``fxc::paged_attention``, ``fxc::rms_norm``, ``fxc::silu_mul``, ``fxc::rope`` and
``fxc::greedy_logprob``, built on first use into one extension module.

``fxc::paged_attention`` has two C++ kernels, both walking the block table in place (no gathered copy
of the context):

* the **decode kernel** (``csrc/paged_attention.cpp``) for calls of one query token per sequence and
  calls with fewer than 15 query rows (tokens x GQA group) per KV head: one pass over each row's
  context for all query heads, long rows cut between threads;
* the **flash kernel** (``csrc/flash_attention.cpp``) for the other multi-token calls (a speculative
  verify step's k + 1 tokens, chunked prefill, prefill): tiles of up to 32 query rows (tokens x the GQA
  group's heads) of one KV head held in vector lanes, 16 keys a step, online softmax (fp32; fp64 for
  double caches), causal/padding/sliding-window masks, softcap and sinks as in the ATen reference;
  work split over (sequence, KV head, row tile) and, when there are few tiles, over context pieces
  merged by log-sum-exp, so batch 1 uses every thread.

Query and cache of different dtypes take the C++ cache write and SDPA over the gathered context.
``install()`` registers the kernels in C++ as the ops' CPU implementations, so no Python runs per call.
"""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from fxcompiler.ops.paged_attention import paged_attention_reference

from . import _build

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = (_CSRC / "paged_attention.cpp", _CSRC / "flash_attention.cpp", _CSRC / "fused_ops.cpp")
_HEADERS = (_CSRC / "simd_math.h", _CSRC / "kv_fp8.h", _CSRC / "bf16_simd.h", _CSRC / "count_dispatch.h")
_lock = threading.Lock()
_state: dict = {"module": None, "tried": False, "error": None}
_installed = False


def _load():
    isa = _build.detect_isa()
    if isa == "aten":
        raise RuntimeError("no AVX2/AVX-512 on this CPU (or FXCOMPILER_CPU_ISA=aten)")
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"] + _build._FLAGS[isa]
    name = f"fxc_paged_attention_{isa}_{_build.source_digest(_SOURCES + _HEADERS, flags)}"
    return _build.load_extension(name, _SOURCES, flags, extra_ldflags=["-fopenmp"])


def kernel_module():
    """The compiled module, or None (with one warning) when it cannot be built here."""
    return _build.load_once(_state, _lock, _load, "fxc::paged_attention CPU kernel unavailable, using the ATen "
                            "reference")


def paged_attention_cpu(query, key, value, k_cache, v_cache, block_table, slot_mapping, query_pos, seq_lens,
                        scale, sliding_window=-1, softcap=0.0, sinks=None):
    """What a CPU call of ``fxc::paged_attention`` runs (query, key and cache of one dtype): the C++ flash
    kernel for several query tokens per sequence with >= 15 query rows per KV head (``g_flash_min_rows``
    in ``csrc/paged_attention.cpp``), the decode kernel otherwise; else the C++ cache write and SDPA over the gathered context; the ATen
    reference when the module cannot be built."""
    mod = kernel_module()
    if mod is not None:
        return mod.paged_attention(query, key, value, k_cache, v_cache, block_table, slot_mapping, query_pos,
                                   seq_lens, scale, sliding_window, softcap, sinks)
    return paged_attention_reference(query, key, value, k_cache, v_cache, block_table, slot_mapping, query_pos,
                                     seq_lens, scale, sliding_window, softcap, sinks)


def _aten_sum_lanes(mod) -> int:
    """The vector width (8 or 16 floats) at which the module's copy of ATen's summation order equals
    ``Tensor.sum`` in this torch build, or 0 when neither does. The bf16 ``rms_norm`` needs it to be
    bit-identical to transformers' RMSNorm (which reduces with ATen); the width is not the CPU's
    (torch 2.13 sums with 8-lane vectors on AVX-512 machines), hence a check, not a guess."""
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randn(3, n, generator=g) * 4) ** 2 for n in (16, 100, 576, 1040, 4100)]
    for lanes in (8, 16):
        if all(torch.equal(mod.aten_row_sums(x, lanes), x.sum(-1)) for x in rows):
            return lanes
    return 0


def install() -> bool:
    """Make the C++ kernels the CPU implementations of ``fxc::paged_attention``, ``rms_norm``, ``silu_mul``,
    ``rope`` and ``greedy_logprob`` (registered from C++, so calls do not pass through Python); True when
    the kernels are active."""
    global _installed
    if kernel_module() is None:
        return False
    with _lock:
        if not _installed:
            import fxcompiler.ops  # noqa: F401  (defines the ops before we implement them)

            mod = _state["module"]
            mod.register_cpu_kernels(aten_sum_lanes=_aten_sum_lanes(mod))
            _installed = True
    return True
