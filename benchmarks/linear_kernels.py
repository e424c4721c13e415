"""Benchmark the fxc CPU linear kernels against torch in the same run.

    python benchmarks/linear_kernels.py            # SmolLM2 shapes, M = 1, 16, 64, fp32/bf16/int8
    python benchmarks/linear_kernels.py --quick    # fewer shapes / shorter timing
    python benchmarks/linear_kernels.py --pool-mb 0   # "hot": one weight, may sit in L2/L3
    python benchmarks/linear_kernels.py --dtypes bf16 --m 64,256,512 --rounds 9 --pool-mb 64 \
        --candidates "x bf16,torch.mm,oneDNN"       # bf16 compute-bound: interleaved rounds

GB/s counts the weight bytes only (N*K*elem_size; int8 = 1 byte, scales excluded),
GFLOP/s = 2*M*N*K / time.  By default each candidate cycles through enough copies of
its weight (``--pool-mb``, per candidate) that a weight is evicted from the
caches before it is used again, as in a decode step that streams the whole model.
Times are medians of per-call times (perf_counter) after warm-up, 2 threads; "best" is the
fastest call.  On a shared VM use --wait-quiet (waits for idle CPUs before each measurement).

Candidates:
  fp32: fxc.linear, the same without the next-panel L2 prefetch of M > 12 (switched off in-process),
        torch.mm(x, W^T pre-transposed), F.linear(x, W), mkl packed (inductor freezing, fp32)
  bf16: fxc.linear (fp32 x), fxc.linear (bf16 x), and where the VDPBF16PS kernel is in use the FMA path it
        replaced (bf16 x, switched off in-process), torch.mm(x, W^T), F.linear(x, W), oneDNN packed
        (mkldnn._linear_pointwise); the torch candidates take bf16 x
  int8: fxc.linear_w8 (per channel, and group 64), fxc.linear_f8 (fp8 e4m3 weights, also 1 byte/weight),
        aten._weight_int8pack_mm (per channel)
  int4: fxc.linear_w4 group 32 (GGUF Q4_1's blocks: scale and min per 32 weights) with the scales and mins
        stored as fp16 (what the native GGUF path builds, 0.625 byte/weight) and as fp32 (0.75),
        fxc.linear_w8 group 32 (GGUF Q8_0's blocks, SmolLM2's output matrix); GB/s counts Q4_1's 20 bytes
        per 32 weights (0.625 byte/weight) for all, so they are comparable with llama.cpp's Q4_1
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import backends.cpu as fxc  # noqa: E402
from backends.cpu import _build  # noqa: E402

SHAPES = [(576, 1536), (1536, 576), (576, 576), (576, 192), (576, 49152)]  # (K, N), SmolLM2-135M
QUICK_SHAPES = [(576, 1536), (1536, 576), (576, 49152)]


def _cpu_busy(window: float = 0.25) -> float:
    """Fraction of all CPUs busy over `window` seconds (Linux /proc/stat)."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]
    a = snap()
    time.sleep(window)
    b = snap()
    return 1.0 - (b[1] - a[1]) / max(1, b[0] - a[0])


def wait_quiet(enabled: bool, threshold: float = 0.08, timeout: float = 60.0) -> None:
    """On a shared machine: wait (up to timeout) until the other tenants leave the CPUs idle."""
    if not enabled or not os.path.exists("/proc/stat"):
        return
    t_end = time.time() + timeout
    while time.time() < t_end and _cpu_busy() > threshold:
        pass


def timeit(fn, argsets, min_time: float, quiet: bool = False) -> tuple[float, float]:
    """(median, best) seconds per call, cycling through argsets."""
    for a in argsets[: min(3, len(argsets))]:
        fn(*a)
    wait_quiet(quiet)
    ts = []
    i = 0
    t_end = time.perf_counter() + min_time
    while time.perf_counter() < t_end or len(ts) < 5:
        a = argsets[i % len(argsets)]
        t = time.perf_counter()
        fn(*a)
        ts.append(time.perf_counter() - t)
        i += 1
    ts.sort()
    return ts[len(ts) // 2], ts[0]


def copies_for(nbytes: int, pool_mb: int) -> int:
    if pool_mb <= 0:
        return 1
    return max(1, min(2000, -(-pool_mb * 2**20 // nbytes)))


def _switched_off(setter, fn):
    """``fn()`` with a kernel switch of ``backends.cpu._build`` off (the path it replaced), then on again."""
    setter(False)
    try:
        return fn()
    finally:
        setter(True)


def candidates(dtype_name: str, k: int, n: int, m_list, pool_mb: int):
    """Yield (name, make_fn(m) -> (fn, argsets)) for one shape and weight dtype."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) / k**0.5
    if dtype_name in ("fp32", "bf16"):
        dt = torch.float32 if dtype_name == "fp32" else torch.bfloat16
        es = 4 if dt == torch.float32 else 2
        c = copies_for(n * k * es, pool_mb)
        wd = w.to(dt)
        wp0 = fxc.pack_linear_weight(wd, dt)
        wps = [wp0.clone() for _ in range(c)]
        yield "fxc.linear", lambda x: (lambda wp: torch.ops.fxc.linear(x, wp, None, n), [(p,) for p in wps])
        if dt == torch.float32:  # M > 12: the same kernel without the next-panel L2 prefetch, same process
            yield "fxc.linear (no panel prefetch)", lambda x: (
                lambda wp: _switched_off(_build.set_panel_prefetch, lambda: torch.ops.fxc.linear(x, wp, None, n)),
                [(p,) for p in wps])
        if dt == torch.bfloat16:  # same kernel fed bf16 activations (bf16 output), as the torch candidates
            yield "fxc.linear (x bf16)", lambda x: (lambda wp, xb=x.bfloat16(): torch.ops.fxc.linear(xb, wp, None, n),
                                                    [(p,) for p in wps])
            if _build.state().get("bf16dot"):  # the FMA path the VDPBF16PS kernel replaced, same process
                yield "fxc.linear (x bf16, FMA)", lambda x: (
                    lambda wp, xb=x.bfloat16(): _switched_off(_build.set_bf16dot,
                                                              lambda: torch.ops.fxc.linear(xb, wp, None, n)),
                    [(p,) for p in wps])
        del wps
        wts = [wd.t().contiguous() for _ in range(c)]
        yield "torch.mm(W^T)", lambda x: (lambda wt: torch.mm(x, wt), [(t,) for t in wts])
        del wts
        ws = [wd.clone() for _ in range(c)]
        yield "F.linear", lambda x: (lambda ww: F.linear(x, ww), [(t,) for t in ws])
        if dt == torch.float32 and torch._C.has_mkl:
            def mkl(x, ws=ws):
                m = x.shape[0]
                pk = [(torch.ops.mkl._mkl_reorder_linear_weight(t, m), t) for t in ws]
                return (lambda p, t: torch.ops.mkl._mkl_linear(x, p, t, None, m), pk)
            yield "mkl packed", mkl
        if dt == torch.bfloat16 and torch.backends.mkldnn.is_available():
            def onednn(x, ws=ws):
                pk = [torch.ops.mkldnn._reorder_linear_weight(t, x.shape[0]) for t in ws]
                return (lambda p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), [(p,) for p in pk])
            yield "oneDNN packed", onednn
        del ws
    elif dtype_name == "int4":
        import backends.cpu.quant  # noqa: F401  (fxc::linear_w4's kernel, quant_kernels.cpp)
        from fxcompiler.ops.quant_linear import quantize_linear_weight_int4

        q4, s4, m4 = quantize_linear_weight_int4(w, 32)
        s4, m4 = s4.half().float(), m4.half().float()  # GGUF's d and m are fp16 values
        for label, (ss4, mm4) in (("fxc.linear_w4 g32 (fp16 s/m)", (s4.half(), m4.half())),
                                  ("fxc.linear_w4 g32 (fp32 s/m)", (s4, m4))):
            c = copies_for(q4.numel() + 2 * ss4.numel() * ss4.element_size(), pool_mb)
            q4s = [(q4.clone(), ss4.clone(), mm4.clone()) for _ in range(c)]
            yield label, lambda x, q4s=q4s: (
                lambda qq, ss, mm: torch.ops.fxc.linear_w4(x, qq, ss, mm, None, n, 32), q4s)
            del q4s
        q, s = fxc.quantize_linear_weight_int8(w, 32)
        qs = [(q.clone(), s.clone()) for _ in range(copies_for(n * k * 9 // 8, pool_mb))]
        yield "fxc.linear_w8 g32", lambda x, qs=qs: (
            lambda qq, ss: torch.ops.fxc.linear_w8(x, qq, ss, None, n, 32), qs)
        del qs
    else:
        c = copies_for(n * k, pool_mb)
        for gs in (-1, 64):
            q, s = fxc.quantize_linear_weight_int8(w, gs)
            qs = [q.clone() for _ in range(c)]
            yield (f"fxc.linear_w8 g{gs if gs > 0 else 'ch'}",
                   lambda x, qs=qs, s=s, gs=gs: (lambda qq: torch.ops.fxc.linear_w8(x, qq, s, None, n, gs),
                                                 [(t,) for t in qs]))
            del qs
        import backends.cpu.quant  # noqa: F401  (fxc::linear_f8's kernel, quant_kernels.cpp)
        from fxcompiler.ops.quant_linear import quantize_linear_weight_fp8

        qf, sf = quantize_linear_weight_fp8(w)
        qfs = [qf.clone() for _ in range(c)]
        yield "fxc.linear_f8 (e4m3)", lambda x, qfs=qfs: (lambda qq: torch.ops.fxc.linear_f8(x, qq, sf, None, n),
                                                         [(t,) for t in qfs])
        del qfs
        q8 = torch.clamp(torch.round(w / (w.abs().amax(1, keepdim=True) / 127)), -127, 127).to(torch.int8)
        sc = (w.abs().amax(1) / 127).contiguous()
        q8s = [q8.clone() for _ in range(c)]
        yield "aten._weight_int8pack_mm", lambda x: (
            lambda qq: torch.ops.aten._weight_int8pack_mm(x, qq, sc.to(x.dtype)), [(t,) for t in q8s])
        del q8s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 shapes, M=1 and 16, short timing")
    ap.add_argument("--m", default=None, help="comma separated M values (default 1,16,64)")
    ap.add_argument("--dtypes", default="fp32,bf16,int8")
    ap.add_argument("--shapes", default=None, help="K:N,K:N,... (default SmolLM2 shapes)")
    ap.add_argument("--pool-mb", type=int, default=None,
                    help="weight MiB cycled per candidate (default 512, --quick 256; 0 = one hot weight)")
    ap.add_argument("--time", type=float, default=None, help="seconds per measurement")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--wait-quiet", action="store_true",
                    help="before each measurement wait until the CPUs are idle (shared machines)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="interleaved rounds: every candidate of a (shape, M) is timed once per round, and the "
                         "median over rounds is shown (a shared machine disturbs all candidates alike)")
    ap.add_argument("--candidates", default=None,
                    help="comma separated substrings: only candidates whose name contains one of them")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    m_list = [int(v) for v in (args.m or ("1,16" if args.quick else "1,16,64")).split(",")]
    shapes = ([tuple(int(t) for t in s.split(":")) for s in args.shapes.split(",")] if args.shapes
              else (QUICK_SHAPES if args.quick else SHAPES))
    pool_mb = args.pool_mb if args.pool_mb is not None else (256 if args.quick else 512)
    min_time = args.time if args.time is not None else (0.05 if args.quick else 0.1)

    t0 = time.perf_counter()
    ok = fxc.kernels_available()
    print(f"# fxc kernels: {ok} isa={fxc.isa()} (build/load {time.perf_counter() - t0:.1f}s), torch {torch.__version__}, "
          f"threads={args.threads}, pool={pool_mb} MB/candidate, {min_time}s/measurement")
    print(f"{'dtype':5} {'K':>5} {'N':>6} {'M':>3}  {'candidate':26} {'us':>9} {'GB/s':>7} {'best':>6} "
          f"{'GFLOP/s':>8}  vs best torch (median)")
    for dtype_name in args.dtypes.split(","):
        es = {"fp32": 4, "bf16": 2, "int8": 1, "int4": 0.625}[dtype_name]
        for k, n in shapes:
            rows = {m: [] for m in m_list}
            wanted = args.candidates.split(",") if args.candidates else None
            made = {m: [] for m in m_list}  # --rounds > 1: (name, fn, argsets) timed in interleaved rounds
            for name, make in candidates(dtype_name, k, n, m_list, pool_mb):
                if wanted and not any(w in name for w in wanted):
                    continue
                for m in m_list:
                    xdt = torch.bfloat16 if (dtype_name == "bf16" and not name.startswith("fxc")) else torch.float32
                    if name.startswith("aten._weight_int8pack_mm"):
                        xdt = torch.bfloat16  # its fp32-activation kernel is far slower on CPU
                    x = torch.randn(m, k).to(xdt)
                    fn, argsets = make(x)
                    if args.rounds > 1:
                        made[m].append((name, fn, argsets))
                    else:
                        rows[m].append((name,) + timeit(fn, argsets, min_time, args.wait_quiet))
                    del fn, argsets
            for m in m_list if args.rounds > 1 else ():
                per = {name: [] for name, _, _ in made[m]}
                for _ in range(args.rounds):
                    for name, fn, argsets in made[m]:
                        per[name].append(timeit(fn, argsets, min_time / args.rounds, args.wait_quiet))
                for name, ts in per.items():
                    med = sorted(t for t, _ in ts)[len(ts) // 2]
                    rows[m].append((name, med, min(b for _, b in ts)))
                made[m].clear()
            for m in m_list:
                best_torch = min((t for nm, t, _ in rows[m] if not nm.startswith("fxc")), default=float("nan"))
                for name, t, tb in rows[m]:
                    gbs = n * k * es / t / 1e9
                    gf = 2 * m * n * k / t / 1e9
                    rel = f"{best_torch / t:5.2f}x" if name.startswith("fxc") else ""
                    print(f"{dtype_name:5} {k:5d} {n:6d} {m:3d}  {name:26} {t * 1e6:9.1f} {gbs:7.1f} "
                          f"{n * k * es / tb / 1e9:6.1f} {gf:8.1f}  {rel}", flush=True)
    print(f"# total {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
