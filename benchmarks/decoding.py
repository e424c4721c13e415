"""Prefix reuse and chunked prefill on SmolLM2-135M-Instruct (fp32), driven step by step on the engine.

1. Time to first token of a request whose first ~1,000 tokens are cached (another request
   with the same prefix ran before), with and without prefix caching.
2. Decode latency of running requests while a ~2,000-token prompt is prefilled: mean and
   worst interval between two tokens of the running requests, before the long prompt
   arrives and while it is prefilled, with chunks (``prefill_chunk_size``) and without.

    .venv/bin/python benchmarks/decoding.py [--chunk 128] [--running 8]

Run it alone on the machine: timings of concurrent jobs are meaningless.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fxcompiler import LLM, SamplingParams
from fxcompiler.models.sources import DEFAULT_MODEL_ID

TEXT = ("The history of computing is a story of abstractions. Early machines were programmed by rewiring, "
        "then by punched cards, then by assembly language, and finally by high-level languages. ") * 200


def token_block(tokenizer, n: int, offset: int = 0) -> list[int]:
    if tokenizer is None:  # a tokenizer-less test model
        return [(7 * (offset + i)) % 200 + 3 for i in range(n)]
    ids = tokenizer(TEXT)["input_ids"]
    return ids[offset:offset + n]


def run_to_first_token(engine, rid: str, ids: list[int]) -> float:
    t0 = time.perf_counter()
    engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def ttft(llm, prefix_len: int, repeats: int) -> dict:
    engine = llm.engine
    tok = llm.tokenizer
    prefix = token_block(tok, prefix_len)
    out = {}
    for caching in (False, True):
        engine.configure(enable_prefix_caching=caching)
        times = []
        for r in range(repeats):
            run_to_first_token(engine, f"warm-{caching}-{r}", prefix + token_block(tok, 16, 3000 + 40 * r))
            times.append(run_to_first_token(engine, f"q-{caching}-{r}", prefix + token_block(tok, 16, 4000 + 40 * r)))
        out["with_reuse" if caching else "without_reuse"] = statistics.median(times)
    out["speedup"] = out["without_reuse"] / out["with_reuse"]
    out["hit_rate"] = engine.stats.prefix_cache_hit_rate
    return out


def decode_latency(llm, long_len: int, running: int, chunk: int | None) -> dict:
    engine = llm.engine
    engine.configure(enable_prefix_caching=False)
    engine.scheduler.prefill_chunk_size = chunk
    tok = llm.tokenizer
    for i in range(running):
        engine.add_request(f"run-{chunk}-{i}", token_block(tok, 32, 64 * i),
                           SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    stamps: list[float] = []
    long_done = None

    def step():
        outs = engine.step()
        if any(o.request_id.startswith("run-") for o in outs):
            stamps.append(time.perf_counter())
        return outs

    for _ in range(running + 20):  # prefills, then a steady decode phase
        step()
    base = [b - a for a, b in itertools.pairwise(stamps)][-10:]
    stamps.clear()
    stamps.append(time.perf_counter())
    engine.add_request(f"long-{chunk}", token_block(tok, long_len, 500),
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while long_done is None:
        outs = step()
        if any(o.request_id == f"long-{chunk}" and o.finished for o in outs):
            long_done = time.perf_counter()
    during = [b - a for a, b in itertools.pairwise(stamps)] + [long_done - stamps[-1]]
    for rid in list(engine.requests):
        engine.abort_request(rid)
    b, d = statistics.mean(base), statistics.mean(during)
    return {"chunk": chunk, "baseline_ms": 1e3 * b, "during_mean_ms": 1e3 * d, "during_max_ms": 1e3 * max(during),
            "mean_ratio": d / b, "max_ratio": max(during) / b}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=1000)
    ap.add_argument("--long", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--running", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=DEFAULT_MODEL_ID)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--random-weight", action="store_true", help="the config's model with random weights")
    ap.add_argument("--disable", nargs="*", default=[], help="passes to disable")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_seq_len_to_capture=args.max_seq_len, max_prompt_len=min(2048, args.max_seq_len),
              use_random_weight=args.random_weight,
              compiler_config_overrides={"passes": {"disable": args.disable}} if args.disable else None)
    res = {"ttft": ttft(llm, args.prefix, 3),
           "decode_latency": [decode_latency(llm, args.long, args.running, c) for c in (args.chunk, None)]}
    res["setup"] = {"model": args.model, "threads": args.threads, "chunk": args.chunk, "running": args.running,
                    "torch": torch.__version__}
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
