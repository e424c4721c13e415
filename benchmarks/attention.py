"""Microbenchmark of the CPU kernels of ``fxc::paged_attention`` against the ATen reference.

    python benchmarks/attention.py                      # SmolLM2-135M geometry, batch 1/16/64, ctx 136/512, fp32+bf16
    python benchmarks/attention.py --compare-src /tmp/old_csrc   # also time another copy of csrc/ (old kernel)
    python benchmarks/attention.py --batch 64 --ctx 136 --dtype fp32 --no-aten
    python benchmarks/attention.py --query-tokens 5,9,128 --batch 1,16 --no-aten   # multi-token calls

Geometry: 9 query heads, 3 KV heads, head_dim 64, block 16 (``--hq/--hkv/--d/--block``).
``--query-tokens`` S (default 1, decode): S query tokens per sequence, the last S positions of a
context of ``ctx`` tokens (their K/V rows are written by the call as in a real step: a speculative
verify step for S = k + 1, a prefill chunk for S = 128); with S > 1 the default contexts are
136/512/2048 and the candidates are the flash kernel (``flash``, what the op runs), the former path
(``sdpa``: cache write + SDPA over the gathered context), the decode kernel (``decode``, S <= 16) and
the ATen reference; the last column is sdpa's median over flash's. Block tables of shuffled block ids.

GB/s = bytes of K and V actually read over the real context (B * ctx * Hkv * D * elem * 2)
divided by the median per-call time.  Each candidate cycles through enough separate caches
(``--pool-mb`` in all, as a decode step cycles through its layers' caches) that K/V come from
DRAM, not from the caches of the last call.  Candidates run interleaved in rounds, so the
noise of this shared VM hits them alike; the figure is the median over all calls, "best" the
fastest call.  2 threads (``--threads``).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from backends.cpu import _build, attention  # noqa: E402
from fxcompiler.ops.paged_attention import paged_attention_reference  # noqa: E402
from linear_kernels import wait_quiet  # noqa: E402  (benchmarks/ is first on sys.path)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_module_from(src_dir: str):
    """Build ``paged_attention.cpp`` + ``fused_ops.cpp`` of another source directory (e.g. the old kernel)."""
    src = Path(src_dir)
    sources = [src / "paged_attention.cpp", src / "fused_ops.cpp"]
    if (src / "flash_attention.cpp").exists():
        sources.insert(1, src / "flash_attention.cpp")
    isa = _build.detect_isa()
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"] + _build._FLAGS[isa]
    name = f"fxc_pa_bench_{isa}_{_build.source_digest(sources + [src / 'simd_math.h'], flags)}"
    return _build.load_extension(name, sources, flags, extra_ldflags=["-fopenmp"])


class Case:
    """Caches for `n_layers` layers carved out of one pool, inputs for one call per layer (`tokens` query
    tokens per sequence: the last `tokens` positions of `ctx`)."""

    def __init__(self, batch, ctx, dtype, hq, hkv, d, bs, pool_mb, seed=0, tokens=1):
        g = torch.Generator().manual_seed(seed)
        self.batch, self.ctx, self.dtype = batch, ctx, dtype
        mb = -(-ctx // bs)
        nb = batch * mb + 1
        elem = torch.tensor([], dtype=dtype).element_size()
        per_layer = 2 * nb * bs * hkv * d
        self.n_layers = max(1, min(4096, int(pool_mb * 2**20 // (per_layer * elem))))
        pool = torch.empty(self.n_layers * per_layer, dtype=dtype)
        chunk = torch.randn(min(per_layer, 1 << 22), generator=g).to(dtype)
        for off in range(0, pool.numel(), chunk.numel()):
            n = min(chunk.numel(), pool.numel() - off)
            pool[off:off + n].copy_(chunk[:n])
        shape = (nb, bs, hkv, d)
        half = per_layer // 2
        self.caches = [(pool[i * per_layer:i * per_layer + half].view(shape),
                        pool[i * per_layer + half:(i + 1) * per_layer].view(shape)) for i in range(self.n_layers)]
        self.table = (torch.randperm(nb - 1, generator=g)[: batch * mb] + 1).view(batch, mb)
        self.lens = torch.full((batch,), ctx, dtype=torch.int64)
        self.pos = (self.lens - tokens).view(batch, 1) + torch.arange(tokens)
        self.slots = self.table.gather(1, self.pos // bs) * bs + self.pos % bs
        self.q = torch.randn(batch, tokens, hq, d, generator=g).to(dtype).transpose(1, 2)
        self.k = torch.randn(batch, hkv, tokens, d, generator=g).to(dtype)
        self.v = torch.randn(batch, hkv, tokens, d, generator=g).to(dtype)
        self.scale = d ** -0.5
        self.kv_bytes = 2 * batch * ctx * hkv * d * elem
        self.i = 0

    def args(self):
        kc, vc = self.caches[self.i % self.n_layers]
        self.i += 1
        return (self.q, self.k, self.v, kc, vc, self.table, self.slots, self.pos, self.lens, self.scale, -1, 0.0)


def bench_case(case: Case, candidates: dict, rounds: int, calls: int, quiet: bool = False) -> dict:
    times = {name: [] for name in candidates}
    for name, fn in candidates.items():  # warm-up (and first-touch of the pool)
        for _ in range(min(case.n_layers, 64)):
            fn(*case.args())
    for _ in range(rounds):
        wait_quiet(quiet, threshold=0.1)
        for name, fn in candidates.items():
            n = calls if name != "aten" else max(2, calls // 4)
            for _ in range(n):
                a = case.args()
                t = time.perf_counter()
                fn(*a)
                times[name].append(time.perf_counter() - t)
    return times


def check(case: Case, candidates: dict) -> None:
    a = case.args()
    ref = paged_attention_reference(*a).float()
    tol = 2e-2 if case.dtype == torch.bfloat16 else 2e-5
    for name, fn in candidates.items():
        torch.testing.assert_close(fn(*a).float(), ref, rtol=tol, atol=tol, msg=f"{name} disagrees with ATen")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--ctx", default=None, help="contexts (default 136,512; 136,512,2048 with --query-tokens > 1)")
    ap.add_argument("--query-tokens", default="1",
                    help="query tokens per sequence, e.g. 5,9,128 (verify steps, a prefill chunk); default 1 (decode)")
    ap.add_argument("--dtype", default="fp32,bf16")
    ap.add_argument("--hq", type=int, default=9)
    ap.add_argument("--hkv", type=int, default=3)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--pool-mb", type=float, default=256, help="K/V bytes cycled through per case (0: one layer, hot)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=40, help="calls per candidate per round (ATen: a quarter)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare-src", help="directory with another paged_attention.cpp/fused_ops.cpp/simd_math.h")
    ap.add_argument("--no-aten", action="store_true")
    ap.add_argument("--wait-quiet", action="store_true",
                    help="before each round wait (up to 60 s) until the other tenants leave the CPUs idle")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    mod = attention.kernel_module()
    old_mod = load_module_from(args.compare_src) if args.compare_src else None
    print(f"isa={_build.detect_isa()} threads={torch.get_num_threads()} hq={args.hq} hkv={args.hkv} d={args.d} "
          f"block={args.block} pool={args.pool_mb} MB")
    for tokens in (int(t) for t in args.query_tokens.split(",")):
        candidates = {}
        if tokens == 1:
            if mod is not None:
                candidates["fxc"] = mod.paged_attention_cpu
                if args.query_tokens != "1":  # the dispatch question: decode kernel or flash kernel at S = 1
                    candidates["flash"] = mod.paged_attention_flash
            if old_mod is not None:
                candidates["old"] = old_mod.paged_attention_cpu
        else:
            if mod is not None:
                candidates["flash"] = mod.paged_attention_flash
                candidates["sdpa"] = mod.paged_attention_sdpa
                if tokens <= 16:
                    candidates["decode"] = mod.paged_attention_cpu
            if old_mod is not None:
                candidates["old"] = old_mod.paged_attention
        if not args.no_aten:
            candidates["aten"] = paged_attention_reference
        ratio = "flash" in candidates and "sdpa" in candidates
        ctxs = args.ctx or ("136,512" if tokens == 1 else "136,512,2048")
        print(f"query tokens per sequence: {tokens}")
        header = f"{'dtype':5} {'batch':>5} {'ctx':>5} {'KV MB':>7} " + " ".join(
            f"{n + ' ms':>10} {n + ' GB/s':>10} {'(best)':>7}" for n in candidates) + (" sdpa/flash" if ratio else "")
        print(header)
        for dname in args.dtype.split(","):
            for batch in (int(b) for b in args.batch.split(",")):
                for ctx in (int(c) for c in ctxs.split(",")):
                    if ctx < tokens:
                        continue
                    case = Case(batch, ctx, DTYPES[dname], args.hq, args.hkv, args.d, args.block, args.pool_mb,
                                tokens=tokens)
                    check(case, candidates)
                    times = bench_case(case, candidates, args.rounds, args.calls, args.wait_quiet)
                    cells = []
                    for name in candidates:
                        med, best = statistics.median(times[name]), min(times[name])
                        cells.append(f"{med * 1e3:10.3f} {case.kv_bytes / med / 1e9:10.1f} "
                                     f"{case.kv_bytes / best / 1e9:7.1f}")
                    if ratio:
                        cells.append(f"{statistics.median(times['sdpa']) / statistics.median(times['flash']):10.2f}")
                    print(f"{dname:5} {batch:5d} {ctx:5d} {case.kv_bytes / 1e6:7.2f} " + " ".join(cells), flush=True)
                    del case


if __name__ == "__main__":
    main()
