"""Parallel decode and throughput against one process (same model, same machine).

    python benchmarks/parallel.py                       # SmolLM2-135M fp32: tp 1/3, pp 2/3, dp 2/3
    python benchmarks/parallel.py --plans 1x1x1,3x1x1,1x3x1,1x1x3 --requests 64 --max-tokens 64
    python benchmarks/parallel.py --tp 1,3              # tensor parallel only

``--plans`` lists tp x pp x dp sizes (SmolLM2: tp in {1, 3}, its 9 query heads).

For each tensor_parallel_size: batch-1 decode ms/token (one request, ``--decode-tokens``
tokens, after a warm-up request), then ``--requests`` requests × ``--max-tokens`` tokens (tok/s),
and the greedy tokens' agreement with tp = 1. The communication share is estimated from the
step's collectives: (2·layers + 2) all-reduces/gathers of the batch's hidden rows per step,
each timed by ``benchmarks/allreduce.py``'s shared-memory p50 at that size (printed). On a
2-core machine tp ranks share the same two cores, so tp > 1 cannot be faster here: the figures
say what the plan costs (communication, per-rank overhead), not what more cores would gain.
For pipeline stages (hidden rows sent stage to stage over gloo) and data-parallel replicas
(no communication) the communication share column shows ``-``. For pipeline plans the
``--requests`` throughput is measured in ``--rounds`` interleaved rounds with the default
micro-batching (a micro-batch per stage, so the stages overlap) and with one batch a step
(``llm.engine.runner.micro_batches = 1``); "pp overlap" is the ratio of the medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _measure(model: str, plan: tuple[int, int, int], args) -> dict:
    from fxcompiler import LLM, SamplingParams

    tp, pp, dp = plan
    t0 = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
              max_seq_len_to_capture=512, dtype=args.dtype)
    start_s = time.perf_counter() - t0
    try:
        prompt = "The history of the printing press"
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))
        t0 = time.perf_counter()
        one = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True))
        ms_per_token = (time.perf_counter() - t0) * 1e3 / len(one.outputs[0].token_ids)
        prompts = [f"Request {i}: tell me about topic number {i * 7 % 31}" for i in range(args.requests)]
        sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        # pipeline stages: one batch a step (micro_batches=1) against the default (one micro-batch
        # per stage, the stages overlapping), interleaved rounds, medians
        runner = getattr(llm.engine, "runner", None)
        variants = [pp, 1] if pp > 1 and runner is not None and hasattr(runner, "micro_batches") else [None]
        rates: dict = {m: [] for m in variants}
        for _ in range(args.rounds if len(variants) > 1 else 1):
            for m in variants:
                if m is not None:
                    runner.micro_batches = m
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp)
                dt = time.perf_counter() - t0
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                rates[m].append(tokens / dt)
        tok_s = statistics.median(rates[variants[0]])
        tok_s_one_batch = statistics.median(rates[1]) if len(variants) > 1 else None
        return {"tp": tp, "pp": pp, "dp": dp, "start_s": start_s, "decode_ms_per_token": ms_per_token, "tok_s": tok_s,
                "tok_s_one_batch": tok_s_one_batch,
                "tokens": [o.outputs[0].token_ids for o in outs], "layers": llm.model_config.num_hidden_layers,
                "hidden": llm.model_config.hidden_size, "comm": llm.build_info.get("comm", "-")}
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--tp", default=None, help="tensor-parallel sizes only (overrides --plans)")
    ap.add_argument("--plans", default="1x1x1,3x1x1,1x2x1,1x3x1,1x1x2,1x1x3", help="tp x pp x dp, comma-separated")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of pp's micro-batch comparison")
    args = ap.parse_args()
    import allreduce

    plans = ([(int(t), 1, 1) for t in args.tp.split(",")] if args.tp
             else [tuple(int(x) for x in p.split("x")) for p in args.plans.split(",")])
    rows = [_measure(args.model, p, args) for p in plans]
    base = rows[0]
    elem = 2 if args.dtype == "bfloat16" else 4
    shm = {}
    worlds = sorted({r["tp"] for r in rows if r["tp"] > 1})
    for w in worlds:
        sizes = (base["hidden"] * elem, base["hidden"] * elem * args.requests)
        shm[w] = {r["bytes"]: r["shm_p50_us"] for r in allreduce.run(world=w, sizes=sizes, iters=300)}
    print(f"{args.model} {args.dtype}; {args.requests} requests x {args.max_tokens} tokens")
    print(f"{'tp':>3} {'pp':>3} {'dp':>3} {'comm':>5} {'start s':>8} {'decode ms/tok':>14} {'tok/s':>8} {'comm share b1':>14} "
          f"{'comm share bN':>15} {'same tokens':>12} {'pp overlap':>11}")
    for r in rows:
        share1 = share64 = "-"
        if r["tp"] > 1 and r["pp"] == 1:
            per_step = 2 * r["layers"] + 2
            us = shm[r["tp"]]
            share1 = f"{per_step * us[base['hidden'] * elem] / 1e3 / r['decode_ms_per_token']:.0%}"
            step_ms = args.requests * 1e3 / r["tok_s"]  # ~ one decode step of the whole batch
            share64 = f"{per_step * us[base['hidden'] * elem * args.requests] / 1e3 / step_ms:.0%}"
        same = sum(a == b for a, b in zip(r["tokens"], base["tokens"]))
        # tok/s with a micro-batch per stage over tok/s with one batch a step
        overlap = f"{r['tok_s'] / r['tok_s_one_batch']:.2f}x" if r.get("tok_s_one_batch") else "-"
        print(f"{r['tp']:>3} {r['pp']:>3} {r['dp']:>3} {r['comm']:>5} {r['start_s']:>8.1f} {r['decode_ms_per_token']:>14.2f} "
              f"{r['tok_s']:>8.1f} {share1:>14} {share64:>15} {same:>6}/{len(base['tokens'])} {overlap:>11}")


if __name__ == "__main__":
    main()
