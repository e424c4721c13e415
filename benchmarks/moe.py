"""Decode step time of a MoE model as the top-k and the expert count vary: with ``fxc::moe`` reading only
the selected experts, time grows with top-k and stays flat in the expert count.

    .venv/bin/python benchmarks/moe.py [--experts 8,32,64,128] [--top-k 1,2,4,8] [--tokens 32] [--rounds 3]

Model: Qwen3-MoE (``fxcompiler.model_zoo``'s ``qwen3_moe``) at hidden 512, 4 layers, 8 query / 4 KV heads,
``moe_intermediate_size`` 256, vocab 8192, fp32, random weights; batch-1 decode from a 16-token prompt. A
step's time is the difference of two generations (8 and 8 + ``tokens`` new tokens) divided by ``tokens``;
the rounds are interleaved over the grid (machine load hits every point alike) and the median is reported.
Also reported: the op alone (``fxc::moe`` on one token's hidden state, median of 200 calls), which isolates
the experts from attention and the LM head. Two tables: step ms per (experts, top-k), and per experts at
top-2 relative to the smallest expert count (acceptance: ≈ 1.0 at every count).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4)
MOE_INTERMEDIATE = 256


def build(experts: int, top_k: int, root: Path):
    from fxcompiler import LLM
    from fxcompiler.model_zoo import zoo_config

    cfg = zoo_config("qwen3_moe", **SIZES)
    cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size = experts, top_k, MOE_INTERMEDIATE
    path = root / f"e{experts}_k{top_k}"
    cfg.save_pretrained(path)
    return LLM(str(path), use_random_weight=True, seed=0, dtype="float32", max_seq_len_to_capture=256,
               cache_dir=None)


def step_seconds(llm, tokens: int) -> float:
    from fxcompiler import SamplingParams

    prompt = [list(range(3, 19))]
    times = []
    for n in (8, 8 + tokens):
        t0 = time.perf_counter()
        llm.generate(None, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), prompt_token_ids=prompt)
        times.append(time.perf_counter() - t0)
    return (times[1] - times[0]) / tokens


def op_seconds(experts: int, top_k: int, calls: int = 200) -> float:
    from fxcompiler.ops.moe import SILU_GLU, SOFTMAX_TOPK, moe

    h, i = SIZES["hidden_size"], MOE_INTERMEDIATE
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(1, h, generator=g), torch.randn(experts, h, generator=g), None,
            torch.randn(experts, 2 * i, h, generator=g) * 0.05, None, torch.randn(experts, h, i, generator=g) * 0.05,
            None, top_k, SOFTMAX_TOPK, True, False, SILU_GLU, False)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        moe(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", default="8,32,64,128")
    ap.add_argument("--top-k", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    experts = [int(x) for x in args.experts.split(",")]
    top_ks = [int(x) for x in args.top_k.split(",")]
    root = Path(tempfile.mkdtemp(prefix="fxc-moe-bench-"))
    grid = [(e, k) for e in experts for k in top_ks if k <= e]
    llms = {point: build(*point, root) for point in grid}
    samples = {point: [] for point in grid}
    ops = {point: [] for point in grid}
    for _ in range(args.rounds):
        for point, llm in llms.items():
            samples[point].append(step_seconds(llm, args.tokens))
            ops[point].append(op_seconds(*point))
    rows = {f"e{e}_k{k}": {"experts": e, "top_k": k, "step_ms": 1e3 * statistics.median(samples[(e, k)]),
                          "op_us": 1e6 * statistics.median(ops[(e, k)])} for e, k in grid}
    print(f"{'experts':>8s} {'top-k':>6s} {'step ms':>9s} {'moe op us':>10s}")
    for r in rows.values():
        print(f"{r['experts']:8d} {r['top_k']:6d} {r['step_ms']:9.2f} {r['op_us']:10.1f}", flush=True)
    base_k = 2 if 2 in top_ks else top_ks[0]
    base = rows.get(f"e{experts[0]}_k{base_k}")
    if base:
        print(f"\nat top-{base_k}, relative to {experts[0]} experts (flat = only the selected experts are read):")
        for e in experts:
            r = rows.get(f"e{e}_k{base_k}")
            if r:
                print(f"{e:8d} experts: step x{r['step_ms'] / base['step_ms']:.2f}, op x{r['op_us'] / base['op_us']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
