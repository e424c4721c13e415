"""Build vs load: SmolLM2 (or --model) built cold (export + passes), built warm (compile-cache
hit), exported as an artifact, and loaded back in a fresh process; greedy tokens compared.

    python benchmarks/artifacts.py [--model M] [--auto-bfloat16-cast] [--json out.json]

Reports seconds for each way in, the load speed-up over a cold build, the artifact's size,
and the loading process's memory: peak RSS growth during ``LLM.load_artifact`` next to
the parameter bytes (the target is <= 1.5x the weights).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Paged attention is"]

LOADER = r"""
import json, sys, time
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import torch
torch.set_num_threads(2)
from fxcompiler import LLM, SamplingParams
import transformers, tokenizers  # imported before the clock starts, like any serving process
rss0 = status("VmRSS")
# reset the peak to "now" so the figure is the load's own growth
open("/proc/self/clear_refs", "w").write("5")
t0 = time.perf_counter()
llm = LLM.load_artifact(sys.argv[1])
seconds = time.perf_counter() - t0
hwm = status("VmHWM")
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=int(sys.argv[3]), temperature=0))
print("RESULT", json.dumps({"load_seconds": seconds, "rss_before": rss0, "peak_rss": hwm,
                            "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--auto-bfloat16-cast", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(2)
    from fxcompiler import LLM, SamplingParams
    from fxcompiler.models.sources import DEFAULT_MODEL_ID

    model = args.model or DEFAULT_MODEL_ID
    kw = {"auto_bfloat16_cast": True} if args.auto_bfloat16_cast else {}
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    figures: dict = {"model": model, "bf16": args.auto_bfloat16_cast}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["FXCOMPILER_COMPILE_CACHE"] = "0"
        t0 = time.perf_counter()
        llm = LLM(model, skip_engine=True, **kw)
        figures["build_cold_seconds"] = time.perf_counter() - t0
        del llm
        os.environ.pop("FXCOMPILER_COMPILE_CACHE")
        LLM(model, skip_engine=True, **kw)  # make sure the compile cache holds this program
        t0 = time.perf_counter()
        llm = LLM(model, artifacts_export_path=Path(tmp) / "artifact", **kw)
        figures["build_warm_plus_export_seconds"] = time.perf_counter() - t0
        figures["compile_cache"] = llm.build_info["compile_cache"]
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
        params_bytes = sum(t.numel() * t.element_size() for t in llm._build.params.values())
        del llm
        t0 = time.perf_counter()
        LLM(model, skip_engine=True, **kw)
        figures["build_warm_seconds"] = time.perf_counter() - t0
        art = Path(tmp) / "artifact"
        figures["artifact_mib"] = sum(f.stat().st_size for f in art.rglob("*") if f.is_file()) / 2**20
        proc = subprocess.run([sys.executable, "-c", LOADER, str(art), json.dumps(PROMPTS), str(args.max_tokens)],
                              capture_output=True, text=True, cwd=ROOT, timeout=900)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return 1
        res = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    figures["load_seconds"] = res["load_seconds"]
    figures["load_speedup_vs_cold_build"] = figures["build_cold_seconds"] / res["load_seconds"]
    figures["params_mib"] = params_bytes / 2**20
    figures["load_rss_growth_mib"] = (res["peak_rss"] - res["rss_before"]) / 2**20
    figures["load_peak_rss_mib"] = res["peak_rss"] / 2**20
    figures["load_rss_growth_over_params"] = (res["peak_rss"] - res["rss_before"]) / params_bytes
    figures["tokens_identical"] = res["tokens"] == expected
    for k, v in figures.items():
        print(f"  {k:32s} {v:.2f}" if isinstance(v, float) else f"  {k:32s} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0 if figures["tokens_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
