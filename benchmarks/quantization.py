"""Accuracy and speed of the quantization schemes on the embedded SmolLM2-135M-Instruct.

Text: CPython's ``pydoc_data.topics`` (ships with every Python), its topics sorted by name and split
deterministically: even-indexed topics are the calibration half (read by no benchmark here; reserved for
calibration), odd-indexed the held-out half, of which the first ``--tokens`` tokens are scored.

Perplexity: windows of ``--window`` tokens advancing by ``--stride``; each window scores only its last
``stride`` tokens (the first window all of them), from the engine's ``prompt_logprobs``.
Greedy agreement: the fraction of greedy tokens equal to fp32's over fixed prompts.
Decode speed: batch-1 decode tokens/s, rounds interleaved between the engines, median reported.

    .venv/bin/python benchmarks/quantization.py [--schemes fp32,bf16,w8a32,w8a16,w4a32-g128,native-q4_1,wf8a16]
        [--model ID_OR_DIR] [--rounds 0]     # qformat-w8a16 / qformat-w4a16-g128: via `fxcompiler quantize`
        # qformat-w4a16-g128-gptq / qformat-w8a16-gptq: `fxcompiler quantize --algorithm gptq`, calibrated on
        # --calib-samples windows of --calib-seq-len tokens of the calibration half
        # [--w-observer minmax|mse] [--gptq-refit] [--gptq-true-sequential]: fxcompiler quantize's options
        # w8a8 (LLM W8A8, RTN), qformat-w8a8[-gptq|-smoothquant] [--smoothquant-alpha A]: fxc::linear_w8a8
        # kv8 / kvf8 (kv_cache_dtype int8 / fp8, built-in calibration), w8a16-kvf8 (W8A16KVf8),
        # qformat-kv8 / qformat-kvf8 / qformat-w8a16+kvf8: `fxcompiler quantize --scheme ...` [--kv-observer
        # minmax|percentile] [--kv-percentile P]; wf8af8 (LLM Wf8Af8: RTN fp8 weights, per-token fp8 activations,
        # fxc::linear_f8f8), qformat-wf8af8[-gptq]: `fxcompiler quantize --scheme wf8af8`

Resident memory (``--rss``, load-independent; no perplexity or speed): each scheme's engine in fresh
processes, first on a cold compile cache (an empty ``FXCOMPILER_CACHE_DIR`` given the built C++ extensions
and autotuning results and converted GGUF models of the current one, so no extension is compiled and the
GGUF is not converted again), then warm (the same directory again):
``VmRSS`` after ``LLM(model)`` (default options) and after 16 requests x 64 greedy tokens, and ``VmHWM`` (the
build's peak on the cold run), from ``/proc/self/status``:

    .venv/bin/python benchmarks/quantization.py --rss --schemes native-q4_1-q8head[,native-q4_1,fp32]

``--rss-compile-in-subprocess`` builds with ``LLM(..., compile_in_subprocess=True)``: the cold build's export
and passes in a child process (fxcompiler/build_isolation.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fxcompiler.calibration import split_topics  # noqa: E402  (calibration / held-out halves)

SCHEMES = ("fp32", "bf16", "w8a32", "w8a16", "w4a32-g128", "w4a16-g128", "native-q4_1", "native-q4_1-q8head",
           "wf8a32", "wf8a16",  # fp8 e4m3 weights (fxc::linear_f8), fp32 / bf16 activations
           "qformat-w8a16", "qformat-w4a16-g128", "qformat-fp8",  # qformat-*: a directory written by `fxcompiler quantize`
           "qformat-w8a16-gptq", "qformat-w4a16-g128-gptq", "qformat-fp8-gptq",  # ...-gptq: with --algorithm gptq
           "w8a8", "qformat-w8a8", "qformat-w8a8-gptq", "qformat-w8a8-smoothquant",  # W8A8: fxc::linear_w8a8
           "kv8", "kvf8", "w8a16-kvf8", "qformat-kv8", "qformat-kvf8", "qformat-w8a16+kvf8",  # quantized KV caches
           "wf8af8", "qformat-wf8af8", "qformat-wf8af8-gptq",  # fp8 activations: fxc::linear_f8f8
           "native-q4_1-a8", "w4a8-g32")  # W4A8 (int8 activations per group, fxc::linear_w4a8): the GGUF's Q4_1, RTN
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colours:", "Water boils at",
           "Once upon a time, in a small village by the sea,", "The best way to learn a language is"]


def llm_kwargs(scheme: str) -> dict:
    from fxcompiler import LLMConfig, QuantizationConfig

    def q(text, **kw):
        return {"llm_config": LLMConfig(quantization_config=QuantizationConfig.from_str(text)), **kw}

    table = {
        "fp32": {}, "bf16": {"auto_bfloat16_cast": True},
        "w8a32": q("W8A32"), "w8a16": q("W8A16"), "w8a8": q("W8A8"), "wf8a32": q("Wf8A32"), "wf8a16": q("Wf8A16"),
        "w4a32-g128": q("W4A32", quantization_group_size=128), "w4a16-g128": q("W4A16", quantization_group_size=128),
        "native-q4_1": {"keep_gguf_quantization": True, "quantize_lm_head": False},  # float head (-q8head: the default)
        "kv8": {"kv_cache_dtype": "int8"}, "kvf8": {"kv_cache_dtype": "fp8"}, "w8a16-kvf8": q("W8A16KVf8"),
        "wf8af8": q("Wf8Af8"),
        "native-q4_1-q8head": {"keep_gguf_quantization": True, "quantize_lm_head": True},
        "native-q4_1-a8": q("W4A8", keep_gguf_quantization=True, quantize_lm_head=True),  # llama.cpp's numerics
        "w4a8-g32": q("W4A8", quantization_group_size=32),
    }
    return table[scheme]


def weight_bytes(llm) -> int:
    return sum(t.numel() * t.element_size() for t in llm._build.params.values())


def perplexity(llm, ids: list[int], window: int, stride: int) -> float:
    from fxcompiler import SamplingParams

    nll, count, start = 0.0, 0, 0
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    while start < len(ids) - 1:
        chunk = ids[start:start + window]
        out = llm.generate(None, sp, prompt_token_ids=[chunk])[0]
        scored_from = 1 if start == 0 else window - stride
        for pos in range(scored_from, len(chunk)):
            entry = out.prompt_logprobs[pos]
            nll -= entry[chunk[pos]].logprob
            count += 1
        if start + window >= len(ids):
            break
        start += stride
    return math.exp(nll / count)


def greedy(llm, max_tokens: int) -> list[list[int]]:
    from fxcompiler import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]


def decode_tps(llm, tokens: int) -> float:
    from fxcompiler import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate("Write a long story about a lighthouse keeper.", sp)
    return tokens / (time.perf_counter() - t0)


RSS_PROMPTS = [f"Request {i}: tell me about the number {i}." for i in range(16)]


def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}


def rss_child(scheme: str, model: str) -> None:
    """One fresh process: build the scheme's engine, run the workload, print the memory figures."""
    from fxcompiler import LLM, SamplingParams

    isolate = os.environ.get("FXC_RSS_COMPILE_IN_SUBPROCESS") == "1"
    llm = LLM(model, **llm_kwargs(scheme), **({"compile_in_subprocess": True} if isolate else {}))
    after_llm = _status()
    llm.generate(RSS_PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    after = _status()
    print("RESULT " + json.dumps({"rss_llm": after_llm["VmRSS"], "rss_workload": after["VmRSS"], "hwm": after["VmHWM"],
                                  "compile_cache": llm.build_info.get("compile_cache")}), flush=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def rss_runs(schemes: list[str], model: str, cache_dir: str | None, compile_in_subprocess: bool = False) -> None:
    """``--rss``: per scheme a cold then a warm process on one cache directory (``compile_in_subprocess``: the
    engines built with ``LLM(..., compile_in_subprocess=True)``)."""
    from fxcompiler.llm import default_cache_dir

    print("| scheme | run | VmRSS after LLM() | after 16 x 64 tokens | VmHWM |\n|---|---|---|---|---|", flush=True)
    for s in schemes:
        with tempfile.TemporaryDirectory(prefix="fxc-rss-") as tmp:
            cache = cache_dir or tmp
            for sub in ("kernels", "autotune", "models"):  # a cold *compile* cache: the built extensions and the
                src = default_cache_dir() / sub               # GGUF's one-time HF conversion are kept
                if src.is_dir() and not os.path.exists(os.path.join(cache, sub)):
                    shutil.copytree(src, os.path.join(cache, sub), symlinks=True, copy_function=_link_or_copy)
            os.chmod(cache, 0o700)
            env = dict(os.environ, FXCOMPILER_CACHE_DIR=cache, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                       FXC_RSS_COMPILE_IN_SUBPROCESS="1" if compile_in_subprocess else "0")
            env["PYTHONPATH"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..") + os.pathsep \
                + env.get("PYTHONPATH", "")
            for run in ("cold", "warm"):
                r = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss-child", s, "--model", model],
                                   env=env, capture_output=True, text=True)
                line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    raise SystemExit(f"{s} ({run}) failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
                res = json.loads(line[7:])
                gib = 1 << 30
                print(f"| {s} | {run} (compile cache {res['compile_cache']}) | {res['rss_llm'] / gib:.3f} GiB | "
                      f"{res['rss_workload'] / gib:.3f} GiB | {res['hwm'] / gib:.3f} GiB |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default="fp32,bf16,w8a32,w8a16,w4a32-g128,native-q4_1")
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                    help="model id or directory (native-* schemes need the embedded GGUF default)")
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens scored")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="decode-speed rounds (0: accuracy only)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--calib-samples", type=int, default=64, help="GPTQ calibration windows (qformat-*-gptq)")
    ap.add_argument("--calib-seq-len", type=int, default=256, help="GPTQ calibration window length in tokens")
    ap.add_argument("--w-observer", default="minmax", choices=("minmax", "mse"),
                    help="weight observer of the qformat-* schemes (fxcompiler quantize --w-observer)")
    ap.add_argument("--gptq-refit", action="store_true", help="qformat-*-gptq: fxcompiler quantize --gptq-refit")
    ap.add_argument("--gptq-true-sequential", action="store_true", help="qformat-*-gptq: --gptq-true-sequential")
    ap.add_argument("--smoothquant-alpha", type=float, default=0.5, help="qformat-w8a8-smoothquant: the migration strength")
    ap.add_argument("--kv-observer", default="minmax", choices=("minmax", "percentile"),
                    help="qformat-kv8 / qformat-kvf8 / qformat-*+kvf8: fxcompiler quantize --kv-observer")
    ap.add_argument("--kv-percentile", type=float, default=None, help="with --kv-observer percentile")
    ap.add_argument("--dry-run", action="store_true", help="check the arguments and exit (builds nothing)")
    ap.add_argument("--rss", action="store_true", help="resident memory of each scheme's engine, cold and warm "
                                                       "compile cache, each a fresh process (see the docstring)")
    ap.add_argument("--rss-cache-dir", default=None, help="--rss: keep the cache here instead of a temporary one")
    ap.add_argument("--rss-compile-in-subprocess", action="store_true",
                    help="--rss: build with LLM(..., compile_in_subprocess=True) (the cold build in a child process)")
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        return rss_child(args.rss_child, args.model)
    from fxcompiler import LLM, ManualBucketConfig

    schemes = [s for s in args.schemes.split(",") if s]
    for s in schemes:
        if s not in SCHEMES:
            raise SystemExit(f"unknown scheme {s!r}; choose from {SCHEMES}")
        if args.rss and s.startswith("qformat-"):
            raise SystemExit(f"--rss measures the LLM-keyword schemes only, not {s!r}")
    if args.dry_run:
        print("schemes:", ", ".join(schemes))
        return
    if args.rss:
        return rss_runs(schemes, args.model, args.rss_cache_dir, args.rss_compile_in_subprocess)
    _, held = split_topics()
    engines, results = {}, {}
    tmp = tempfile.TemporaryDirectory(prefix="fxc-quant-bench-")
    for s in schemes:
        t0 = time.perf_counter()
        model, kw = args.model, {}
        if s.startswith("qformat-"):  # quantize into a directory first, then load it as a model
            from fxcompiler.gptq import GPTQConfig
            from fxcompiler.quantize_model import quantize_model

            scheme = s.removeprefix("qformat-").removesuffix("-gptq").removesuffix("-smoothquant")
            algorithm = "gptq" if s.endswith("-gptq") else "smoothquant" if s.endswith("-smoothquant") else "rtn"
            extra = {"smoothquant_alpha": args.smoothquant_alpha} if algorithm == "smoothquant" else {}
            if "kv" in scheme:
                extra.update(kv_observer=args.kv_observer, kv_percentile=args.kv_percentile)
            model = str(quantize_model(args.model, os.path.join(tmp.name, s), scheme, algorithm=algorithm, **extra,
                                       num_samples=args.calib_samples, seq_len=args.calib_seq_len, progress=False,
                                       gptq=GPTQConfig(observer=args.w_observer, refit=args.gptq_refit,
                                                       true_sequential=args.gptq_true_sequential),
                                       observer=args.w_observer))
        else:
            kw = llm_kwargs(s)
        engines[s] = LLM(model, max_seq_len_to_capture=args.window + 64,
                         bucket_config=ManualBucketConfig([(1, args.window)], [(1, args.window + 64)]), **kw)
        results[s] = {"build_s": round(time.perf_counter() - t0, 1), "weight_bytes": weight_bytes(engines[s])}
        print(f"{s}: built in {results[s]['build_s']} s", flush=True)
    ids = engines[schemes[0]].tokenizer(held)["input_ids"][:args.tokens]
    ref = None
    for s in schemes:
        results[s]["ppl"] = round(perplexity(engines[s], ids, args.window, args.stride), 4)
        toks = greedy(engines[s], args.greedy_tokens)
        ref = ref if ref is not None else toks
        same = sum(a == b for x, y in zip(toks, ref) for a, b in zip(x, y))
        results[s]["greedy_agreement_vs_first"] = round(same / sum(len(x) for x in ref), 4)
        print(s, results[s], flush=True)
    speeds = {s: [] for s in schemes}
    for _ in range(args.rounds):  # interleaved rounds
        for s in schemes:
            speeds[s].append(decode_tps(engines[s], args.decode_tokens))
    for s in schemes:
        results[s]["decode_tok_s_median"] = round(statistics.median(speeds[s]), 2) if speeds[s] else None
    base = results[schemes[0]]["ppl"]
    print(f"\n| scheme | weight MiB | held-out PPL | vs {schemes[0]} | greedy agreement | batch-1 decode tok/s |")
    print("|---|---|---|---|---|---|")
    for s in schemes:
        r = results[s]
        print(f"| {s} | {r['weight_bytes'] / 2**20:.1f} | {r['ppl']:.3f} | {100 * (r['ppl'] / base - 1):+.2f} % | "
              f"{100 * r['greedy_agreement_vs_first']:.1f} % | {r['decode_tok_s_median']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
