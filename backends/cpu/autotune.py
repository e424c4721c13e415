"""Build-time autotuner for ``fxc::linear``: is the prepacked kernel faster than the ATen op it
would replace, for this weight shape, dtype and machine?

:class:`LinearAutotuner` implements :class:`fxcompiler.ops.linear.LinearKernelTuner`: the façade
(``fxcompiler/build.py``) puts one in ``ctx.options['kernel_tuner']`` for CPU builds and
``passes/lower_cpu_kernels`` asks it for timings, then decides (the decision rule is the pass's).

Measurement: a random ``[N, K]`` weight of the given dtype, activations of the same dtype,
``M`` rows for each M asked; candidates ``fxc::linear`` on the packed weight and the baseline
(``matmul``: ``x @ W[K, N]`` contiguous, what ``weight_layout`` emits; ``linear``: ``F.linear``).
Before each timed call the candidate's weight is flushed from every cache level (``_build.evict``:
clflush, not timed), so each call reads its weight from DRAM as a step does in situ: a step reads all of a
model's weights once, more bytes than the last-level cache keeps for SmolLM2 in fp32 (538 MB). Timed from
the cache instead (the copies below, all of them in a 480 MiB L3), MKL won at M = 16 for q/k/v and o_proj
(1.2–1.6×) and took the M = 5–32 range, while in the engine the kernel was faster there: a 32-token fp32
prefill 41.5 → 37–39 ms with every matmul lowered (Intel family 6 model 167, 2026-12-05). Weights over
``EVICT_MAX_BYTES`` (32 MiB; flushing one costs ~0.7 ms per MB, 80 ms a call for SmolLM2's fp32 lm_head), or
without the kernel library, are not flushed: each candidate then cycles through copies of its weight
(``pool_bytes`` in all, default 64 MiB) so that small weights are not timed from L2 alone. Calls of the two
candidates alternate and the 25th percentile of each counts (on a shared host a call can lose a scheduler slice). A candidate
more than ``CLEAR_LOSS_RATIO`` times slower on a cold and a warm call (or by seconds on the cold
one) is decided without rounds, and once ATen lost by that much at some M, a larger M (which
cannot take it less time) times the kernel only and records ATen's time as that lower bound:
ATen's bf16 matmul without AVX-512-BF16 took 40 s a call for SmolLM2's lm_head at M = 256. When over
``max_stalled`` of the calls stall even on a second try, the timings serve this build but are
not cached.

Cache: ``$FXCOMPILER_CACHE_DIR/autotune/linear-<kernel build name>[-amx].json`` (default
``~/.cache/fxcompiler``, as for the kernel builds); the build name already encodes the ISA, a
hash of the kernel sources and flags, and the torch version. Entries are keyed by K, N, weight
dtype, baseline, the Ms and the thread count. A corrupt file is ignored (re-measured).
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from fxcompiler.ops.linear import LinearTimings, pack_linear_weight

from . import _build

log = logging.getLogger("fxcompiler.autotune")

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
# Below both of these rates (the faster candidate's bytes streamed and flops) a timing is a
# scheduler stall, not a kernel: even ATen's slowest memory-bound candidate streams > 3 GB/s
# here (README), a stalled call ~0.1 GB/s; a compute-bound call (large M) may stream less than
# 1 GB/s of weight and still run at tens of GFLOP/s (AVX2: 100+ GFLOP/s at M = 256).
MIN_PLAUSIBLE_BYTES_PER_S = 1e9
MIN_PLAUSIBLE_FLOPS = 2e9
# A candidate this many times slower than the other on its first timed call is decided without
# the interleaved rounds (ATen's bf16 matmul without AVX-512-BF16 takes ~1 s at M = 256, K = 576,
# N = 3072 against the kernel's 8 ms: timing it 20 times cost minutes per build).
CLEAR_LOSS_RATIO = 10.0
NO_STALL_LASTS_S = 0.5  # a cold call that loses by this much more is decided on its own
EVICT_MAX_BYTES = 32 << 20  # weights up to this size are flushed from the caches before each timed call


class LinearAutotuner:
    """Times ``fxc::linear`` against the ATen op per (K, N, dtype); results cached as JSON."""

    def __init__(self, pool_bytes: int = 64 << 20, seconds_per_shape: float = 0.25, max_stalled: float = 0.5):
        self.pool_bytes = pool_bytes
        self.seconds_per_shape = seconds_per_shape
        self.max_stalled = max_stalled
        self._entries: dict[str, dict] | None = None
        self._unreliable: dict[str, tuple[dict, dict]] = {}  # stalled measurements: this process's nodes only
        self._lock = threading.Lock()
        self.measured = 0  # measurements taken (not read from the cache) by this tuner

    # -- LinearKernelTuner -------------------------------------------------------------------------
    def isa(self) -> str:
        """'avx512+amx' | 'avx512+bf16dot' | 'avx512' | 'avx2', or 'aten' when the kernels cannot run here (builds on first call)."""
        if not _build.ensure_loaded():
            return "aten"
        st = _build.state()
        return st["isa"] + _build.isa_suffix(st)

    def measure(self, k: int, n: int, weight_dtype: torch.dtype, baseline: str = "matmul",
                ms: Sequence[int] = (1, 64)) -> LinearTimings:
        if weight_dtype not in _DTYPES:
            raise ValueError(f"fxc::linear has no kernel for {weight_dtype} weights")
        if baseline not in ("matmul", "linear"):
            raise ValueError(f"baseline must be 'matmul' or 'linear', got {baseline!r}")
        ms = tuple(int(m) for m in ms)
        _build.ensure_loaded()  # the cache file is named after the loaded kernel build
        key = (f"K{k}_N{n}_{_DTYPES[weight_dtype]}_{baseline}_M{'-'.join(map(str, ms))}_t{torch.get_num_threads()}"
               "_cold")  # this policy: weights up to EVICT_MAX_BYTES flushed before each timed call (older entries
        # timed every weight from the cache)
        with self._lock:
            entries = self._load()
            hit = entries.get(key)
            if hit is not None:
                try:
                    return LinearTimings({int(m): float(t) for m, t in hit["fxc"].items()},
                                         {int(m): float(t) for m, t in hit["aten"].items()}, cached=True,
                                         info={"key": key})
                except (KeyError, TypeError, ValueError, AttributeError):
                    pass  # malformed entry: measure again
            if key in self._unreliable:  # another node of the shape: the same build's decision, not re-timed
                fxc, aten = self._unreliable[key]
                return LinearTimings(dict(fxc), dict(aten), cached=False, info={"key": key, "unreliable": True})
            fxc, aten, stalled = self._measure(k, n, weight_dtype, baseline, ms)
            self.measured += 1
            info = {"key": key, "stalled": round(stalled, 3)}
            if stalled > self.max_stalled:
                # Most calls lost scheduler slices even on the retry: use it for this build, do not keep it.
                log.warning("autotune fxc::linear %s: %.0f%% of the calls stalled (busy host); timings not cached",
                            key, 100 * stalled)
                info["unreliable"] = True
                self._unreliable[key] = (fxc, aten)
            else:
                entries[key] = {"fxc": {str(m): t for m, t in fxc.items()}, "aten": {str(m): t for m, t in aten.items()},
                                "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                self._store(key, entries[key])
        return LinearTimings(fxc, aten, cached=False, info=info)

    # -- cache --------------------------------------------------------------------------------------
    def cache_file(self) -> Path:
        st = _build.state()
        name = Path(st["path"]).stem if st.get("path") else f"unbuilt_{_build.detect_isa()}"
        return _build.cache_root() / "autotune" / f"linear-{name}{_build.isa_suffix(st).replace('+', '-')}.json"

    def _load(self) -> dict[str, dict]:
        if self._entries is None:
            self._entries = _read_json(self.cache_file())
        return self._entries

    def _store(self, key: str, entry: dict) -> None:
        path = self.cache_file()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            merged = _read_json(path)  # another process may have added entries meanwhile
            merged[key] = entry
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))
            os.replace(tmp, path)
        except OSError as exc:  # read-only cache: keep the result for this process only
            log.warning("autotune cache %s not written: %s", path, exc)

    # -- measurement ------------------------------------------------------------------------------
    def _measure(self, k: int, n: int, dtype: torch.dtype, baseline: str, ms: tuple[int, ...]):
        gen = torch.Generator().manual_seed(k * 131071 + n)
        w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype)
        # the library flushes: one copy each, flushed before every timed call (up to EVICT_MAX_BYTES: a flush costs
        # ~0.7 ms per MB, 80 ms a call for SmolLM2's fp32 lm_head, which would add seconds to a cold build)
        cold = w.numel() * w.element_size() <= EVICT_MAX_BYTES and _build.evict(w[:1])
        copies = 1 if cold else max(1, min(16, self.pool_bytes // max(1, w.numel() * w.element_size())))
        packed = [pack_linear_weight(w) for _ in range(copies)]
        dense = [w.t().contiguous() if baseline == "matmul" else w.clone() for _ in range(copies)]
        preps = [lambda i: _build.evict(packed[i % copies]), lambda i: _build.evict(dense[i % copies])] if cold else None
        w_bytes = w.numel() * w.element_size()
        del w
        fxc_t, aten_t, worst = {}, {}, 0.0
        floor, floored = 0.0, []  # ATen's slowest time so far: more rows never take it less
        with torch.inference_mode():
            for m in sorted(ms):
                x = torch.randn(m, k, generator=gen).to(dtype)
                if baseline == "matmul":
                    def ref(i, x=x):
                        return torch.matmul(x, dense[i % copies])
                else:
                    def ref(i, x=x):
                        return F.linear(x, dense[i % copies])

                def fxc(i, x=x):
                    return torch.ops.fxc.linear.default(x, packed[i % copies], None, n)

                if floor:
                    fxc(0)
                    prep = preps[0] if preps else None
                    est = min(_timed(fxc, 1, prep), _timed(fxc, 2, prep))
                    if floor > CLEAR_LOSS_RATIO * est:  # ATen loses by far even at a smaller M: not run
                        fxc_t[m], aten_t[m] = est, floor
                        floored.append(m)
                        continue
                for _attempt in range(2):
                    (fxc_t[m], aten_t[m]), stalled = _bench([fxc, ref], self.seconds_per_shape / len(ms), preps)
                    if stalled <= self.max_stalled:
                        break
                fastest = min(fxc_t[m], aten_t[m])
                moved = w_bytes + (m * k + m * n) * x.element_size()
                if moved / fastest < MIN_PLAUSIBLE_BYTES_PER_S and 2 * m * k * n / fastest < MIN_PLAUSIBLE_FLOPS:
                    stalled = 1.0  # every call stalled (e.g. one of the two cores taken): not a measurement
                worst = max(worst, stalled)
                floor = max(floor, aten_t[m])
        log.info("autotune fxc::linear K=%d N=%d %s vs %s: %s", k, n, _DTYPES[dtype], baseline,
                 ", ".join(f"M={m} {fxc_t[m] * 1e6:.1f}/{'>=' if m in floored else ''}{aten_t[m] * 1e6:.1f} us"
                           for m in ms))
        return fxc_t, aten_t, worst


def _timed(f, i: int, prep=None) -> float:
    if prep is not None:
        prep(i)  # not timed (the weight flush)
    t0 = time.perf_counter()
    f(i)
    return max(time.perf_counter() - t0, 1e-7)


def _bench(fns, budget_s: float, preps=None) -> tuple[list[float], float]:
    """Per-call times of each ``fn(i)``, calls interleaved (fn0, fn1, fn0, ...) so that contention
    hits every candidate alike; returns the 25th percentile of each, and the largest fraction of
    stalled calls (over 3x that candidate's fastest) of any candidate. ``preps[j](i)``, when given, runs
    untimed before each call of ``fns[j]`` (the autotuner flushes the call's weight from the caches).

    A low percentile, not the mean: on a shared host a call can lose a scheduler slice (an
    OpenMP barrier waits for a descheduled thread), and the decision is cached for good."""
    preps = list(preps) if preps is not None else [None] * len(fns)
    first = [_timed(f, 0, p) for f, p in zip(fns, preps)]  # first calls: warm-up costs only make a candidate look slower
    slow, fast = first.index(max(first)), first.index(min(first))
    if first[slow] > CLEAR_LOSS_RATIO * first[fast] + NO_STALL_LASTS_S:  # seconds lost: no scheduler slice
        return first, 0.0
    clear = first[slow] > CLEAR_LOSS_RATIO * first[fast]
    first = [_timed(f, 1, p) for f, p in zip(fns, preps)]  # warmed-up calls
    if clear and first[slow] > CLEAR_LOSS_RATIO * first[fast]:  # the slower one lost by far twice: no rounds
        return first, 0.0
    est = [min([t] + [_timed(f, i, p) for i in range(2, 4)]) for f, p, t in zip(fns, preps, first)]
    calls = max(20, min(5000, int(budget_s / sum(est))))
    samples: list[list[float]] = [[] for _ in fns]
    clock = time.perf_counter
    deadline = clock() + 4 * budget_s  # stalls must not stretch a build: stop early, keep what was measured
    for i in range(calls):
        for f, p, out in zip(fns, preps, samples):
            if p is not None:
                p(i)
            t0 = clock()
            f(i)
            out.append(clock() - t0)
        if i >= 4 and clock() > deadline:
            break
    stalled = max(sum(t > 3 * min(s) for t in s) / len(s) for s in samples)
    return [sorted(s)[len(s) // 4] for s in samples], stalled


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
