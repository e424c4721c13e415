"""Supertask kinds side by side on SmolLM2 (fp32, 2 threads, one process, same weights):
build time cold (export + passes + pipelines + kind conversion; for edf every package
compiled afresh into an empty package directory, with each ``--compile-workers`` count) and
warm (compile-cache and package-cache hits), unique graph blobs, and batch-1 decode tokens/s
per kind next to transformers.

    .venv/bin/python benchmarks/kinds.py [--kinds fx,dfg,edf] [--compile-workers 1,2] [--tokens 64] [--json out.json]

Kinds that are not implemented (or fail to build here) are reported as such, not skipped
silently. Run it alone on the machine.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "The history of computing is a story of abstractions. Early machines were programmed by"


def median_decode_rate(run, tokens: int, reps: int) -> float:
    """Median tokens/s after the first token: ``run(n)`` generates ``n`` tokens, returns seconds."""
    run(4)
    rates = []
    for _ in range(reps):
        first = run(1)
        rates.append((tokens - 1) / (run(tokens) - first))
    return statistics.median(rates)


@contextmanager
def fresh_edf_packages():
    """edf packages compiled into (and looked up in) an empty temporary directory, so a cold
    build compiles every package instead of finding it in ``cache_dir/edf``."""
    from fxcompiler import edf

    original = edf.package_dir
    with tempfile.TemporaryDirectory(prefix="kinds-edf-") as tmp:
        edf.package_dir = lambda cache_dir: Path(tmp) / "edf"
        try:
            yield
        finally:
            edf.package_dir = original


def decode_tok_s(llm, tokens: int, reps: int) -> float:
    from fxcompiler import SamplingParams

    def run(n):
        t0 = time.perf_counter()
        llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0

    return median_decode_rate(run, tokens, reps)


def hf_decode_tok_s(model, tok, tokens: int, reps: int) -> float:
    ids = tok(PROMPT, return_tensors="pt")

    def run(n):
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=tok.pad_token_id or tok.eos_token_id)
        return time.perf_counter() - t0

    return median_decode_rate(run, tokens, reps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="fx,dfg,edf")
    ap.add_argument("--compile-workers", default="1,2", help="edf cold builds with each num_compile_workers")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-seq-len-to-capture", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(2)
    from fxcompiler import LLM
    from fxcompiler.models.sources import DEFAULT_MODEL_ID

    common = {"max_seq_len_to_capture": args.max_seq_len_to_capture}
    rows = {}
    for kind in args.kinds.split(","):
        row: dict = {}
        try:
            os.environ["FXCOMPILER_COMPILE_CACHE"] = "0"
            workers = [int(w) for w in args.compile_workers.split(",")] if kind == "edf" else [1]
            for w in workers:
                with fresh_edf_packages():
                    t0 = time.perf_counter()
                    # the engine starts in the cold build too: cold and warm measure the same LLM(...)
                    llm = LLM(DEFAULT_MODEL_ID, comp_supertask_kind=kind, num_compile_workers=w, **common)
                    seconds = time.perf_counter() - t0
                row.setdefault("build_cold_s", seconds)
                row.setdefault("build_cold_s_by_compile_workers", {})[w] = seconds
                del llm
                gc.collect()
            os.environ.pop("FXCOMPILER_COMPILE_CACHE")
            LLM(DEFAULT_MODEL_ID, comp_supertask_kind=kind, skip_engine=True, **common)  # fill the cache
            t0 = time.perf_counter()
            llm = LLM(DEFAULT_MODEL_ID, comp_supertask_kind=kind, **common)
            row["build_warm_s"] = time.perf_counter() - t0
            row["compile_cache"] = llm.build_info["compile_cache"]
            row["build_cache"] = llm.build_info.get("build_cache")
            row["unique_blobs"] = len({b.id for p in llm.pipelines for b in p.blobs.values()})
            row["supertasks_per_pipeline"] = len(llm.pipelines[0].compute_supertasks())
            row["decode_tok_s"] = decode_tok_s(llm, args.tokens, args.reps)
            del llm
            gc.collect()
        except NotImplementedError as exc:
            row = {"status": f"not implemented: {exc}"}
        except Exception as exc:  # noqa: BLE001 - reported, the other kinds still run
            row = {"status": f"failed: {type(exc).__name__}: {str(exc)[:300]}"}
        rows[kind] = row
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fxcompiler.llm import CACHE_DIR
    from fxcompiler.models.loader import model_directory
    from fxcompiler.models.sources import resolve_model_source

    model_dir = model_directory(resolve_model_source(DEFAULT_MODEL_ID), CACHE_DIR)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf_rate = hf_decode_tok_s(hf, tok, args.tokens, args.reps)
    print(f"transformers batch-1 decode: {hf_rate:.1f} tok/s")
    for kind, row in rows.items():
        if "decode_tok_s" in row:
            row["ratio_vs_transformers"] = row["decode_tok_s"] / hf_rate
            cold = "/".join(f"{v:.1f}" for v in row["build_cold_s_by_compile_workers"].values())
            workers = "/".join(str(w) for w in row["build_cold_s_by_compile_workers"])
            print(f"{kind:4s} cold {cold} s ({workers} compile workers)  warm {row['build_warm_s']:5.1f} s "
                  f"({row['compile_cache']}/{row['build_cache']})  blobs {row['unique_blobs']} ({row['supertasks_per_pipeline']} "
                  f"supertasks/pipeline)  decode {row['decode_tok_s']:5.1f} tok/s = "
                  f"{row['ratio_vs_transformers']:.2f}x transformers")
        else:
            print(f"{kind:4s} {row['status']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"transformers_decode_tok_s": hf_rate, "kinds": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
