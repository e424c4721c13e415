"""A/B of ``fxc::linear_w4``'s decode path (M = 1) at SmolLM2's shapes.

Candidates, timed in interleaved rounds in one process (a shared host disturbs all of them alike):

* ``2026-12-04 fp32 s/m``: the kernel as of git 97674a9 (one panel at a time, fp32 scales and mins), built from
  git beside the current one under the op name ``fxcold::linear_w4``;
* ``now fp32 s/m`` / ``now fp16 s/m``: the current kernel with fp32 and with fp16 scales and mins (fp16 is what
  the native GGUF build uses).

    .venv/bin/python benchmarks/linear_w4_decode.py --threads 2 --pool-mb 256 --rounds 9   # weights from DRAM
    .venv/bin/python benchmarks/linear_w4_decode.py --threads 1 --pool-mb 0 --cpu-time     # hot, CPU time per call

GB/s = Q4_1 bytes (0.625 byte per weight) per second of the median call, then the median over rounds. Each
candidate cycles through ``--pool-mb`` of weight copies so that a call reads its weight from DRAM, as a decode
step does. Needs git and a C++ compiler (the old kernel is built into ``$TMPDIR/fxc_w4_ab``).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

OLD_REV = "97674a9"
SHAPES = [(576, 576), (192, 576), (960, 576), (1536, 576), (3072, 576), (576, 1536)]  # (N, K)


def build_old_kernel() -> None:
    """Build the OLD_REV quant_kernels.cpp with its linear_w4 registered as ``fxcold::linear_w4``."""
    from torch.utils.cpp_extension import load

    from backends.cpu import _build

    src = subprocess.run(["git", "show", f"{OLD_REV}:backends/cpu/csrc/quant_kernels.cpp"], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    i = src.index("TORCH_LIBRARY_IMPL(fxc, CPU, m) {")
    src = src[:i] + ('TORCH_LIBRARY(fxcold, m) {\n  m.def("linear_w4(Tensor x, Tensor w_int4_packed, Tensor scales, '
                     'Tensor mins, Tensor? bias, int n, int group_size) -> Tensor");\n'
                     '  m.impl("linear_w4", c10::DispatchKey::CPU, TORCH_FN(fxcq::linear_w4));\n}\n')
    src = src.replace('"C" const char* fxc_quant_kernels_isa()', '"C" const char* fxcold_quant_kernels_isa()')
    build = os.path.join(tempfile.gettempdir(), "fxc_w4_ab")
    os.makedirs(build, exist_ok=True)
    with open(os.path.join(build, "old.cpp"), "w") as f:
        f.write(src)
    isa = _build.detect_isa()
    load(f"fxcold_w4_{isa}", [os.path.join(build, "old.cpp")],
         extra_cflags=_build._COMMON_FLAGS + _build._FLAGS[isa] + ["-ffp-contract=off"],
         extra_ldflags=["-fopenmp"], build_directory=build, is_python_module=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pool-mb", type=int, default=256, help="weight MiB cycled per candidate (0: one hot weight)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--m", type=int, default=1, help="rows of x (the decode path takes M <= 4)")
    ap.add_argument("--cpu-time", action="store_true", help="time with the thread's CPU clock (loaded hosts)")
    args = ap.parse_args(argv)

    import backends.cpu.quant as quant
    from fxcompiler.ops.quant_linear import linear_w4, pack_int4

    if not quant.ensure_loaded():
        raise SystemExit("the fxc quant kernels are not available (no compiler or no AVX2)")
    build_old_kernel()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    print(f"# isa {quant.isa()}, threads {args.threads}, pool {args.pool_mb} MB/candidate, M={args.m}, "
          f"{'CPU' if args.cpu_time else 'wall'} time, medians of {args.rounds} rounds")
    for n, k in SHAPES:
        g = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        s = (torch.randn(n, k // 32, generator=g) * 0.05).half().float()
        mn = (torch.randn(n, k // 32, generator=g) * 0.3).half().float()
        w32, w16 = pack_int4(q, s, mn, 32), pack_int4(q, s, mn, 32, compact=True)
        x = torch.randn(args.m, k)

        def pool(w):
            nbytes = sum(t.numel() * t.element_size() for t in w)
            copies = max(1, args.pool_mb * 2**20 // nbytes) if args.pool_mb else 1
            return [tuple(t.clone() for t in w) for _ in range(copies)]

        cands = {"2026-12-04 fp32 s/m": (torch.ops.fxcold.linear_w4, pool(w32)),
                 "now fp32 s/m": (linear_w4, pool(w32)), "now fp16 s/m": (linear_w4, pool(w16))}
        ref = linear_w4(x, *w32, None, n, 32)
        for fn, ws in cands.values():
            torch.testing.assert_close(fn(x, *ws[0], None, n, 32), ref, rtol=1e-4, atol=1e-4)
        res = {c: [] for c in cands}
        for _ in range(args.rounds):
            for c, (fn, ws) in cands.items():
                ts = []
                for i in range(max(40, 2 * len(ws))):
                    w = ws[i % len(ws)]
                    t = clock()
                    fn(x, *w, None, n, 32)
                    ts.append(clock() - t)
                ts.sort()
                res[c].append(ts[len(ts) // 2])
        cells = []
        for c, v in res.items():
            med = sorted(v)[len(v) // 2]
            cells.append(f"{c}: {med * 1e6:7.1f} us {n * k * 0.625 / med / 1e9:5.1f} GB/s")
        print(f"N={n:5d} K={k:4d}  " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
