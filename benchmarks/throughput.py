"""fxcompiler vs transformers, side by side in one process, same weights and threads.

Measures batch-1 time-to-first-token and decode tokens/s, and the throughput of N
requests with prompts of mixed length (transformers: one padded static batch through
``generate``; fxcompiler: continuous batching through ``LLM.generate``). Reports ratios.
Peak RSS of fxcompiler alone is measured in a child process. fxcompiler runs without its prefix
cache (``enable_prefix_caching=False``), since every round repeats the same prompts.

    .venv/bin/python benchmarks/throughput.py            # SmolLM2-135M, fp32, 2 threads, 3 interleaved rounds
    .venv/bin/python benchmarks/throughput.py --quick    # fewer tokens/requests
    .venv/bin/python benchmarks/throughput.py --auto-bfloat16-cast   # bf16 vs transformers bf16
    .venv/bin/python benchmarks/throughput.py --disable lower_cpu_kernels   # without a pass
    .venv/bin/python benchmarks/throughput.py --kind edf   # AOTInductor-package supertasks
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = (
    "The history of computing is a story of abstractions. Early machines were programmed by rewiring, then by "
    "punched cards, then by assembly language, and finally by high-level languages whose compilers translate "
    "human intent into instructions. Modern machine learning systems repeat this pattern: a model is written "
    "in a framework, captured as a graph, optimised by passes, and lowered to kernels that run on a device. "
    "Each layer hides the one below it, and each layer must be correct for the whole to work. "
) * 8


def prompts_of_mixed_length(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    ids = tokenizer(TEXT)["input_ids"]
    out = []
    for _ in range(n):
        start = rng.randrange(0, len(ids) - hi)
        out.append(tokenizer.decode(ids[start:start + rng.randint(lo, hi)]))
    return out


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hf_runners(model, tok, prompt: str, prompts: list[str], new_tokens: int, reps: int):
    ids = tok(prompt, return_tensors="pt")
    gen = dict(do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)

    def run(n):
        with torch.inference_mode():
            model.generate(**ids, max_new_tokens=n, min_new_tokens=n, **gen)

    tok.padding_side = "left"
    batch = tok(prompts, return_tensors="pt", padding=True)

    def run_batch():
        with torch.inference_mode():
            model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **gen)

    run(2)
    return _runners(run, run_batch, len(prompts), new_tokens, reps)


def fx_runners(llm, prompt: str, prompts: list[str], new_tokens: int, reps: int):
    from fxcompiler import SamplingParams

    def run(n):
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    run(2)
    return _runners(run, lambda: llm.generate(prompts, sp), len(prompts), new_tokens, reps)


def _runners(run, run_batch, requests: int, new_tokens: int, reps: int):
    def batch1() -> dict:
        ttft = median_time(lambda: run(1), reps)
        total = median_time(lambda: run(new_tokens), reps)
        return {"ttft_ms": ttft * 1e3, "decode_tok_s": (new_tokens - 1) / (total - ttft)}

    def batch() -> dict:
        t = median_time(run_batch, 1)
        return {"batch_tok_s": requests * new_tokens / t, "batch_seconds": t}

    return batch1, batch


def interleaved_rounds(hf, fx, rounds: int) -> tuple[dict, dict, dict]:
    """Each round measures transformers and fxcompiler back to back (which goes first alternates), so a
    burst of load from other tenants of a shared VM hits one round's pair, not one side; the reported
    figures are medians over rounds and the ratios medians of the per-round ratios."""
    per_round: list[dict] = []
    for r in range(rounds):
        res: dict = {}
        for phase in (0, 1):  # batch-1 (ttft, decode), then the batch workload
            order = (("hf", hf), ("fx", fx)) if r % 2 == 0 else (("fx", fx), ("hf", hf))
            for name, (batch1, batch) in order:
                res.setdefault(name, {}).update(batch1() if phase == 0 else batch())
        per_round.append(res)
    med = lambda side, key: statistics.median(x[side][key] for x in per_round)  # noqa: E731
    keys = ("ttft_ms", "decode_tok_s", "batch_tok_s", "batch_seconds")
    hf_r = {k: med("hf", k) for k in keys} | {"rounds": [x["hf"] for x in per_round]}
    fx_r = {k: med("fx", k) for k in keys} | {"rounds": [x["fx"] for x in per_round]}
    def speedups(key: str, higher_is_better: bool = True) -> list[float]:
        return [x["fx"][key] / x["hf"][key] if higher_is_better else x["hf"][key] / x["fx"][key] for x in per_round]

    decode, throughput = speedups("decode_tok_s"), speedups("batch_tok_s")
    ratios = {
        "batch1_decode": statistics.median(decode),
        "ttft_speedup": statistics.median(speedups("ttft_ms", higher_is_better=False)),
        "throughput": statistics.median(throughput),
        "throughput_per_round": throughput,
        "batch1_decode_per_round": decode,
    }
    return hf_r, fx_r, ratios


def rss_child(args) -> int:
    """Run fxcompiler alone (load + batch workload) and print its peak RSS in MiB."""
    from fxcompiler import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, **llm_kwargs(args))
    prompts = prompts_of_mixed_length(llm.tokenizer, args.requests, 16, args.max_prompt)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True))
    print(json.dumps({"peak_rss_mib": peak_rss_mib()}))
    return 0


def llm_kwargs(args) -> dict:
    # transformers recomputes every prompt; with the prefix cache on, the repeated rounds would time cache hits
    kw = {"enable_prefix_caching": False}
    if args.auto_bfloat16_cast:
        kw["auto_bfloat16_cast"] = True
    if args.disable:
        kw["compiler_config_overrides"] = {"passes": {"disable": list(args.disable)}}
    if args.kind:
        kw["comp_supertask_kind"] = args.kind
    return kw


def child_flags(args) -> list[str]:
    flags = ["--auto-bfloat16-cast"] if args.auto_bfloat16_cast else []
    for name in args.disable or ():
        flags += ["--disable", name]
    if args.kind:
        flags += ["--kind", args.kind]
    return flags


def peak_rss_mib() -> float:
    """High-water RSS of this process image (VmHWM; ru_maxrss would include the forking parent's)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    from fxcompiler.models.sources import DEFAULT_MODEL_ID

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL_ID)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved rounds of both engines (medians reported; shared VMs are noisy)")
    p.add_argument("--quick", action="store_true", help="32 new tokens, 16 requests, 1 rep, 1 round")
    p.add_argument("--auto-bfloat16-cast", action="store_true",
                   help="fxcompiler with auto_bfloat16_cast=True against transformers in bf16")
    p.add_argument("--disable", action="append", metavar="PASS", help="disable a default pass (repeatable)")
    p.add_argument("--kind", choices=["fx", "dfg", "edf"], default=None, help="comp_supertask_kind (default: fx)")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child run")
    p.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "throughput.json"))
    args = p.parse_args()
    if args.quick:
        args.new_tokens, args.requests, args.reps, args.rounds = 32, 16, 1, 1
    if args.rss_child:
        return rss_child(args)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fxcompiler import LLM
    from fxcompiler.models.loader import model_directory
    from fxcompiler.models.sources import resolve_model_source

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, **llm_kwargs(args))
    path = model_directory(resolve_model_source(args.model), llm.cache_dir)
    hf_dtype = torch.bfloat16 if args.auto_bfloat16_cast else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=hf_dtype).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    prompt = tok.decode(tok(TEXT)["input_ids"][:32])
    prompts = prompts_of_mixed_length(tok, args.requests, 16, args.max_prompt)

    hf_run = hf_runners(hf, tok, prompt, prompts, args.new_tokens, args.reps)
    fx_run = fx_runners(llm, prompt, prompts, args.new_tokens, args.reps)
    hf_r, fx_r, ratios = interleaved_rounds(hf_run, fx_run, args.rounds)
    fx_r["preemptions"] = llm.engine.stats.preemptions
    del hf, llm, hf_run, fx_run
    rss = float("nan")
    if not args.no_rss:
        child = subprocess.run([sys.executable, __file__, "--rss-child", "--model", args.model, "--threads",
                                str(args.threads), "--new-tokens", str(args.new_tokens), "--requests",
                                str(args.requests), "--max-prompt", str(args.max_prompt), *child_flags(args)],
                               capture_output=True, text=True, check=True)
        rss = json.loads(child.stdout.strip().splitlines()[-1])["peak_rss_mib"]
    result = {
        "model": args.model, "dtype": str(hf_dtype).removeprefix("torch."), "disabled_passes": args.disable or [],
        "threads": args.threads, "new_tokens": args.new_tokens, "requests": args.requests,
        "torch": torch.__version__, "transformers": hf_r, "fxcompiler": fx_r, "fxcompiler_peak_rss_mib": rss,
        "rounds": args.rounds,
        "ratios": {
            "batch1_decode": ratios["batch1_decode"],
            "ttft_speedup": ratios["ttft_speedup"],
            f"throughput_{args.requests}": ratios["throughput"],
            "batch1_decode_per_round": ratios["batch1_decode_per_round"],
            f"throughput_{args.requests}_per_round": ratios["throughput_per_round"],
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"| metric | transformers | fxcompiler | ratio |\n|---|---|---|---|")
    print(f"| batch-1 decode tok/s | {hf_r['decode_tok_s']:.1f} | {fx_r['decode_tok_s']:.1f} | "
          f"{result['ratios']['batch1_decode']:.2f}x |")
    print(f"| TTFT ms (~32-token prompt) | {hf_r['ttft_ms']:.0f} | {fx_r['ttft_ms']:.0f} | "
          f"{result['ratios']['ttft_speedup']:.2f}x |")
    print(f"| {args.requests} requests x {args.new_tokens} tokens, tok/s | {hf_r['batch_tok_s']:.1f} | "
          f"{fx_r['batch_tok_s']:.1f} | {result['ratios'][f'throughput_{args.requests}']:.2f}x |")
    print(f"| fxcompiler peak RSS (alone) | | {rss:.0f} MiB | |")
    rt = ratios["throughput_per_round"]
    print(f"medians of {args.rounds} interleaved rounds; per-round ratios: batch-1 "
          + " ".join(f"{x:.2f}" for x in ratios["batch1_decode_per_round"])
          + f", {args.requests} requests " + " ".join(f"{x:.2f}" for x in rt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
