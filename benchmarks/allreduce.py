"""All-reduce latency between ranks of one host: shared memory (``fxc::all_reduce``) beside gloo.

    python benchmarks/allreduce.py                    # 2 ranks, fp32, 2-16 KB (+ 64 KB, 1 MB)
    python benchmarks/allreduce.py --world 3 --iters 2000

Each rank is a spawned process with one thread; both paths run in the same processes on the
same ``torch.distributed`` group, interleaved per size (shm, then gloo). Reported: p50 and p90
of per-call wall time on rank 0 (µs), and whether the shm result equals the sum of the ranks'
inputs in rank order (bit for bit) and gloo's result (allclose). On a shared machine the ranks
wait for each other's time slices: p50 is the figure, p90 shows the contention.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_SIZES = (2048, 4096, 8192, 16384, 65536, 1 << 20)


def _rank(rank: int, world: int, port: int, sizes, iters: int, dtype: str, queue) -> None:
    import torch.distributed as dist

    from backends.cpu.comm import join_shm_group, leave_shm_group
    from fxcompiler.ops.collectives import all_gather_reference, all_reduce_reference

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD.group_name
        shm = join_shm_group(group)
        dt = getattr(torch, dtype)
        rows = []
        for nbytes in sizes:
            n = max(1, nbytes // torch.empty((), dtype=dt).element_size())
            inputs = [torch.randn(n, generator=torch.Generator().manual_seed(1000 * r + n)).to(dt)
                      for r in range(world)]
            expect = inputs[0].clone()
            for t in inputs[1:]:
                expect = expect + t
            x = inputs[rank]
            got = torch.ops.fxc.all_reduce(x, group)
            ref = all_reduce_reference(x, group)
            gathered = torch.ops.fxc.all_gather(x.view(1, -1), world, group)
            exact = bool(torch.equal(got, expect)) and bool(torch.equal(gathered, torch.stack(inputs)))
            close = bool(torch.allclose(got.double(), ref.double(), rtol=1e-5, atol=1e-5))
            times = {}
            for name, fn in (("shm", lambda: torch.ops.fxc.all_reduce(x, group)),
                             ("gloo", lambda: all_reduce_reference(x, group))):
                count = iters if name == "shm" else max(20, iters // 20)
                for _ in range(min(20, count)):
                    fn()
                dist.barrier()
                ts = []
                for _ in range(count):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                ts.sort()
                times[name] = (ts[len(ts) // 2] * 1e6, ts[int(len(ts) * 0.9)] * 1e6)
            rows.append({"bytes": n * x.element_size(), "shm_p50_us": times["shm"][0], "shm_p90_us": times["shm"][1],
                         "gloo_p50_us": times["gloo"][0], "gloo_p90_us": times["gloo"][1], "exact": exact,
                         "matches_gloo": close, "shm": shm})
        if rank == 0:
            queue.put(rows)
        leave_shm_group(group)
    finally:
        dist.destroy_process_group()


def run(world: int = 2, sizes=DEFAULT_SIZES, iters: int = 1000, dtype: str = "float32", timeout: float = 300.0):
    """Spawn ``world`` ranks and return rank 0's rows (one per size)."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, tuple(sizes), iters, dtype, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    import queue as queue_mod

    deadline = time.monotonic() + timeout
    try:
        while True:  # a rank that dies fails the run at once instead of after the timeout
            try:
                rows = queue.get(timeout=0.5)
                break
            except queue_mod.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"all-reduce benchmark failed: rank exit codes {dead or 'timeout'}")
    finally:
        for p in procs:
            p.join(60)  # exiting ranks tear gloo down; on a loaded host that takes longer than 10 s
            if p.is_alive():
                p.kill()
                p.join()
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        raise RuntimeError(f"a rank exited with {bad}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="bytes, comma-separated")
    args = ap.parse_args()
    rows = run(args.world, [int(s) for s in args.sizes.split(",")], args.iters, args.dtype)
    print(f"{args.world} ranks, {args.dtype}, 1 thread each; p50 / p90 µs per all-reduce (rank 0)")
    print(f"{'bytes':>9} {'shm p50':>9} {'shm p90':>9} {'gloo p50':>9} {'gloo p90':>9} {'gloo/shm':>9}  exact  =gloo")
    for r in rows:
        print(f"{r['bytes']:>9} {r['shm_p50_us']:>9.1f} {r['shm_p90_us']:>9.1f} {r['gloo_p50_us']:>9.1f} "
              f"{r['gloo_p90_us']:>9.1f} {r['gloo_p50_us'] / r['shm_p50_us']:>8.1f}x  {r['exact']!s:>5}  "
              f"{r['matches_gloo']!s:>5}")


if __name__ == "__main__":
    main()
