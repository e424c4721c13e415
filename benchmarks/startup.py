"""Start-up time of the main command's path: ``LLM(SmolLM2)`` then the first generated token, with
fresh caches (``FXCOMPILER_CACHE_DIR`` an empty temporary directory: C++ extensions built, autotuning
measured, program compiled) and warm (same cache, a second process). Each run is its own process.

    .venv/bin/python benchmarks/startup.py [--runs cold,warm] [--env FXCOMPILER_PREBUILD=0] [--chat]

Prints seconds to ``LLM(...)`` returned and to the first token, per run, with the CPU seconds of the
process's main thread to ``LLM(...)`` returned (a figure other tenants of a shared VM move less than wall
time); ``--chat``: also the seconds of a first ``LLM.chat`` after that (its template rendering).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
c0 = time.thread_time()
from fxcompiler import LLM, SamplingParams
llm = LLM("HuggingFaceTB/SmolLM2-135M-Instruct")
t1 = time.perf_counter()
c1 = time.thread_time()
llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=1))
t2 = time.perf_counter()
out = {"llm_s": t1 - t0, "first_token_s": t2 - t0, "llm_main_cpu_s": c1 - c0}
if "--chat" in sys.argv:
    llm.chat([{"role": "user", "content": "What is the capital of France?"}],
             SamplingParams(temperature=0, max_tokens=1))
    out["first_chat_s"] = time.perf_counter() - t2
from backends.cpu import prebuild
print("RESULT " + json.dumps({**out, "prebuild": prebuild.timings}))
"""


def run_once(cache_dir: str, env_extra: dict[str, str], chat: bool = False) -> dict:
    env = dict(os.environ, FXCOMPILER_CACHE_DIR=cache_dir, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **env_extra)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", CHILD, *(["--chat"] if chat else [])], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"start-up run failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="cold,warm")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the child processes")
    ap.add_argument("--cache-dir", default=None,
                    help="use (and keep) this FXCOMPILER_CACHE_DIR instead of a fresh temporary one: "
                         "`--runs warm,warm,warm --cache-dir DIR` re-measures warm starts against one cold build")
    ap.add_argument("--chat", action="store_true", help="also time a first LLM.chat after the first token")
    args = ap.parse_args(argv)
    env_extra = dict(e.split("=", 1) for e in args.env)
    with contextlib.ExitStack() as stack:
        cache = args.cache_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="fxc-startup-"))
        for kind in args.runs.split(","):
            res = run_once(cache, env_extra, args.chat)
            extra = ", ".join(f"{k} {v:.2f}s" for k, v in res["prebuild"].items())
            print(f"{kind:5}  LLM() {res['llm_s']:6.2f} s (main thread CPU {res['llm_main_cpu_s']:5.2f} s)  "
                  f"first token {res['first_token_s']:6.2f} s"
                  + (f"  first chat {res['first_chat_s']:5.2f} s" if "first_chat_s" in res else "")
                  + (f"  (extensions: {extra})" if extra else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
