"""Batch-1 decode of SmolLM2-135M: fxcompiler (``LLM.generate``) and llama.cpp (``llama-bench``) side by side.

The issue's batch-1 targets (fp32 ≥ 50, bf16 ≥ 95 tok/s) are llama.cpp's figures on this kind of
machine; the VM's speed moves by ±15 % from one minute to the next, so the fair comparison is the
two engines interleaved in one run on the same weights. Build llama-bench and the GGUFs first
(``bash scripts/build_llamacpp.sh``: llama.cpp from the llama-cpp-python sdist, F32/BF16 GGUFs
converted from the checkpoint fxcompiler runs), then

    .venv/bin/python benchmarks/llamacpp.py [--rounds 3] [--dtypes fp32,bf16]

Per round and dtype: ``llama-bench -p 0 -n 128 -r 3 -t 2`` (decode of 128 tokens from an empty
context, mean of 3) and fxcompiler's decode tok/s as ``benchmarks/throughput.py`` measures it
((128 - 1) / (time of 128 tokens - time to first token), medians of 3, a 32-token prompt: its
contexts are 32 tokens longer than llama-bench's). Reports medians and per-round ratios.
Run it alone on the machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import TEXT, fx_runners  # noqa: E402

DEFAULT_WORK = Path.home() / ".cache" / "fxcompiler" / "llamacpp"


def llama_bench(binary: Path, gguf: Path, tokens: int, threads: int, reps: int) -> float:
    """Mean decode tok/s of ``llama-bench`` (tg``tokens``)."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t", str(threads),
                          "-r", str(reps), "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    return float(next(r for r in rows if r.get("n_gen") == tokens)["avg_ts"])


def main() -> int:
    from fxcompiler import LLM
    from fxcompiler.models.sources import DEFAULT_MODEL_ID

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=DEFAULT_WORK, help="scripts/build_llamacpp.sh's directory")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "llamacpp.json"))
    args = p.parse_args()
    binary = next(args.work.glob("llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-bench"), None)
    if binary is None:
        raise SystemExit(f"no llama-bench under {args.work}: run `bash scripts/build_llamacpp.sh` first")
    torch.set_num_threads(args.threads)
    result = {"tokens": args.tokens, "threads": args.threads, "torch": torch.__version__}
    for dtype in args.dtypes.split(","):
        gguf = args.work / f"smollm2-{'f32' if dtype == 'fp32' else dtype}.gguf"
        if not gguf.exists():
            raise SystemExit(f"{gguf} is missing: run `bash scripts/build_llamacpp.sh` first")
        llm = LLM(DEFAULT_MODEL_ID, auto_bfloat16_cast=dtype == "bf16")
        prompt = llm.tokenizer.decode(llm.tokenizer(TEXT)["input_ids"][:32])
        batch1, _ = fx_runners(llm, prompt, [prompt], args.tokens, 3)
        fx, cpp = [], []
        for _ in range(args.rounds):
            cpp.append(llama_bench(binary, gguf, args.tokens, args.threads, 3))
            fx.append(batch1()["decode_tok_s"])
        ratios = [f / c for f, c in zip(fx, cpp)]
        result[dtype] = {"fxcompiler": fx, "llama_cpp": cpp, "ratios": ratios}
        print(f"{dtype}: fxcompiler {statistics.median(fx):.1f} tok/s ({' / '.join(f'{v:.1f}' for v in fx)}), "
              f"llama.cpp {statistics.median(cpp):.1f} ({' / '.join(f'{v:.1f}' for v in cpp)}), "
              f"ratio {statistics.median(ratios):.2f} ({' / '.join(f'{r:.2f}' for r in ratios)})", flush=True)
        del llm
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
