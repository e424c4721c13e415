"""`fxcompiler bench serve` against `fxcompiler serve`, beside the offline ``LLM.generate`` of the same workload.

    .venv/bin/python benchmarks/serving.py [--model ID] [--num-prompts 64] [--max-concurrency 64]
        [--input-len 32] [--output-len 128] [--rounds 3] [--json out.json]

One run, interleaved rounds: (1) the server (a subprocess on 127.0.0.1, the same engine options as the
offline LLM) driven by the bench client in this process — all ``--num-prompts`` streamed
``/v1/completions`` requests, at most ``--max-concurrency`` in flight, greedy, ``ignore_eos``, a fixed
output length; (2) ``LLM.generate`` in this process on the same prompts and sampling parameters, while
the server sits idle. Output tokens per second for both, the ratio per round and its median (the issue's
target: served ≥ 0.85× offline at 64-way concurrency), and the bench's TTFT/TPOT/ITL/E2E percentiles.
The client shares the machine with the server, as on any single-host measurement; run it alone.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from fxcompiler import SamplingParams
    from fxcompiler.serving import bench
    from tests.serving import server_process

    torch.set_num_threads(args.threads)
    flags = ["--threads", str(args.threads), "--max-seq-len-to-capture", "512", "--max-prompt-len", "256"]  # default buckets
    work = Path(tempfile.mkdtemp(prefix="fxc-bench-serving-"))
    server_process.SERVE_FLAGS = []  # the tests' small buckets: the server gets exactly the offline LLM's flags
    server = server_process.start_server(args.model, work, served_name="bench", extra_flags=flags)
    try:
        from fxcompiler.engine_args import EngineArgs

        eargs = EngineArgs.from_cli_args(EngineArgs.add_cli_args(argparse.ArgumentParser(), positional_model=True)
                                         .parse_args([args.model, *flags, "--cache-dir", str(work / "cache")]))
        llm = eargs.create_llm()
        prompts = bench._prompts(args.num_prompts, args.input_len, 0)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        bargs = argparse.Namespace(base_url=server.base_url, model="bench", api_key=None,
                                   num_prompts=args.num_prompts, request_rate=float("inf"),
                                   max_concurrency=args.max_concurrency, input_len=args.input_len,
                                   output_len=args.output_len, seed=0, timeout=600.0, result_json=None,
                                   no_progress=True)

        def offline() -> float:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)

        offline(), bench.bench(bargs)  # warm-up: buckets compiled, autotuned, caches filled
        served, local, results = [], [], []
        for _ in range(args.rounds):
            res = bench.bench(bargs)
            if res.failed:
                raise RuntimeError(f"{res.failed} requests failed: {res.errors}")
            served.append(res.output_throughput)
            results.append(res)
            local.append(offline())
        ratios = [s / o for s, o in zip(served, local)]
        mid = results[sorted(range(len(served)), key=served.__getitem__)[len(served) // 2]]
        out = {"model": args.model, "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
               "input_len_words": args.input_len, "output_len": args.output_len, "rounds": args.rounds,
               "threads": args.threads, "served_tok_s": served, "offline_tok_s": local, "ratios": ratios,
               "ratio_median": statistics.median(ratios), "median_round_bench": asdict(mid)}
        print(f"served {statistics.median(served):.1f} output tok/s, offline {statistics.median(local):.1f}; "
              f"ratio {statistics.median(ratios):.3f} (per round {', '.join(f'{r:.3f}' for r in ratios)}; "
              f"target >= 0.85)")
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            d = getattr(mid, name)
            print(f"{name[:-3].upper():5s} ms  p50 {d['p50']:.1f}  p90 {d['p90']:.1f}  p99 {d['p99']:.1f}")
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        llm.shutdown()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
