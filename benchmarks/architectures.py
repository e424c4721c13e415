"""Batch-1 decode tokens/s of a mid-size random config of each zoo architecture, relative to a Llama of
the same size, in one process with the rounds interleaved (so machine load hits every architecture alike).

    .venv/bin/python benchmarks/architectures.py [--arch qwen3 --arch gemma2 ...] [--rounds 3] [--tokens 64]

Sizes: hidden 512, 4 layers, 8 query / 4 KV heads, intermediate 1408, vocab 8192, fp32 (MoE: the zoo's
expert counts with that intermediate size per expert). Decode time per token is the difference of two
generations (8 and 8 + tokens new tokens) from the same 16-token prompt, divided by ``tokens``.
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

SIZES = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4)


def build(name: str, root: Path):
    from fxcompiler import LLM
    from fxcompiler.model_zoo import zoo_config

    cfg = zoo_config(name, **SIZES)
    cfg.save_pretrained(root / name)
    return LLM(str(root / name), use_random_weight=True, seed=0, dtype="float32", max_seq_len_to_capture=256,
               cache_dir=None)


def decode_seconds_per_token(llm, tokens: int) -> float:
    from fxcompiler import SamplingParams

    prompt = [list(range(3, 19))]
    times = []
    for n in (8, 8 + tokens):
        t0 = time.perf_counter()
        llm.generate(None, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), prompt_token_ids=prompt)
        times.append(time.perf_counter() - t0)
    return (times[1] - times[0]) / tokens


def main(argv=None) -> int:
    from fxcompiler.model_zoo import zoo_names

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = ["llama"] + [n for n in (args.arch or zoo_names()) if n != "llama"]
    root = Path(tempfile.mkdtemp(prefix="fxc-arch-bench-"))
    llms = {}
    for n in names:
        try:
            llms[n] = build(n, root)
        except Exception as e:  # reported, not skipped silently
            print(f"{n}: build failed: {type(e).__name__}: {e}", flush=True)
    samples = {n: [] for n in llms}
    for _ in range(args.rounds):
        for n, llm in llms.items():
            samples[n].append(decode_seconds_per_token(llm, args.tokens))
    base = statistics.median(samples["llama"])
    rows = {}
    print(f"{'architecture':20s} {'tok/s':>8s} {'vs llama':>9s}")
    for n, s in samples.items():
        med = statistics.median(s)
        rows[n] = {"tok_s": 1 / med, "relative_to_llama": base / med}
        print(f"{n:20s} {1 / med:8.1f} {base / med:9.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
