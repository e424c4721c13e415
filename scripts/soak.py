"""Soak test: many concurrent streams with random cancellations and bad requests, LLM objects
created and shut down in a loop; checks outputs, RSS, threads and KV blocks.

    .venv/bin/python scripts/soak.py --streams 300 --duration 600     # the long run (issue 16)
    .venv/bin/python scripts/soak.py --streams 24 --duration 40       # short (tests/reliability)

The model is a tiny random-weight Llama (2 layers, hidden 64) with SmolLM2's tokenizer, so
streams carry real text. Every good request that is not cancelled must stream exactly the text
greedy ``generate`` gives for it alone; bad requests (out-of-vocabulary ids, a request that
can never fit the KV cache, a capped ``logprobs``) must be refused with a ValueError/TypeError
while the others go on. Each cycle creates an ``LLM`` (a compile-cache hit), runs a wave of
streams, checks ``check_invariants()`` and that every block is free again, and shuts it down.
At the end the RSS must be within ``--rss-tolerance`` of its value after the first cycle and
no ``fxcompiler-engine`` thread may be left. Prints one JSON line of figures; exit status 1 on
any failure.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _malloc_trim() -> None:
    """Return glibc's free heap pages to the OS, so RSS measures what is still referenced
    (freed memory the allocator keeps is not a leak)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def tiny_model_with_tokenizer(root: Path) -> Path:
    """A tiny random Llama whose vocabulary is SmolLM2's, with SmolLM2's tokenizer files."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fxcompiler.llm import default_cache_dir
    from fxcompiler.models.loader import convert_gguf
    from fxcompiler.models.sources import DEFAULT_MODEL_ID, resolve_model_source

    src = resolve_model_source(DEFAULT_MODEL_ID)
    smol = convert_gguf(src.path, src.model_id, default_cache_dir())
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    out = root / "tiny-smoltok"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (smol / name).is_file():
            shutil.copy(smol / name, out / name)
    return out


PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "List three colours:",
           "In 1969, the first", "The quick brown fox", "Water boils at", "My favourite food is",
           "A haiku about rain:", "import numpy as np\n", "Dear Sir or Madam,", "The meaning of life"]


def make_llm(model: Path, cache: Path, blocks: int):
    from fxcompiler import LLM

    return LLM(str(model), max_seq_len_to_capture=128, cache_dir=cache, paged_attention_num_blocks=blocks)


async def one_stream(llm, rng: random.Random, expected: dict, stats: dict, errors: list) -> None:
    from fxcompiler import SamplingParams

    kind = rng.random()
    if kind < 0.12:  # bad requests: each must be refused, naming the problem
        which = rng.randrange(3)
        try:
            if which == 0:
                agen = llm.stream_generate("", SamplingParams(max_tokens=4), prompt_token_ids=[1, 10**6])
            elif which == 1:
                agen = llm.stream_generate("x " * 10, SamplingParams(max_tokens=110, temperature=0))
            else:
                agen = llm.stream_generate("hi", SamplingParams(max_tokens=4, logprobs=10**4))
            async for _ in agen:
                pass
            errors.append(f"bad request {which} was accepted")
        except (ValueError, TypeError):
            stats["bad_refused"] += 1
        return
    prompt = rng.choice(PROMPTS)
    max_tokens = rng.choice(MAX_TOKENS)
    cancel_after = rng.randint(1, 6) if kind < 0.35 else None
    from fxcompiler import SamplingParams

    text = []
    async for delta in llm.stream_generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0)):
        text.append(delta)
        if cancel_after is not None and len(text) >= cancel_after:
            stats["cancelled"] += 1
            return
    got = "".join(text)
    want = expected[(prompt, max_tokens)]
    if got != want:
        errors.append(f"stream {prompt!r}/{max_tokens} gave {got!r}, alone it gives {want!r}")
    stats["completed"] += 1


MAX_TOKENS = (4, 8, 16, 24)


def reference_outputs(llm) -> dict:
    """Each (prompt, max_tokens) generated alone, greedy: what its stream must give."""
    from fxcompiler import SamplingParams

    return {(p, m): llm.generate(p, SamplingParams(max_tokens=m, temperature=0)).outputs[0].text
            for p in PROMPTS for m in MAX_TOKENS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=300, help="total streams over the run")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds the run should last (approximately)")
    ap.add_argument("--wave", type=int, default=12, help="concurrent streams per LLM cycle")
    ap.add_argument("--blocks", type=int, default=6, help="KV blocks of each LLM (small: forces preemption and "
                    "refuses the never-fitting bad request)")
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-trim", dest="trim", action="store_false",
                    help="do not malloc_trim(0) after each cycle (RSS then includes freed heap glibc keeps)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fxc-soak-"))
    work.mkdir(parents=True, exist_ok=True, mode=0o700)
    model = tiny_model_with_tokenizer(work)
    cache = work / "cache"
    rng = random.Random(args.seed)
    ref_llm = make_llm(model, cache, 256)
    expected = reference_outputs(ref_llm)
    ref_llm.shutdown()
    del ref_llm
    gc.collect()

    stats = {"completed": 0, "cancelled": 0, "bad_refused": 0, "cycles": 0, "streams": 0, "preemptions": 0}
    errors: list[str] = []
    rss_after_first = None
    rss_samples = []
    threads_before = {t.ident for t in threading.enumerate()}
    t0 = time.monotonic()
    cycles = max(1, -(-args.streams // args.wave))
    per_cycle_s = args.duration / cycles
    for c in range(cycles):
        tc = time.monotonic()
        llm = make_llm(model, cache, args.blocks)
        n = min(args.wave, args.streams - stats["streams"])

        async def wave():
            tasks = []
            for _ in range(n):
                tasks.append(asyncio.create_task(one_stream(llm, rng, expected, stats, errors)))
                await asyncio.sleep(rng.random() * 0.02)
            res = await asyncio.gather(*tasks, return_exceptions=True)
            for r in res:
                if isinstance(r, BaseException):
                    errors.append(f"stream raised {type(r).__name__}: {r}")

        asyncio.run(wave())
        stats["streams"] += n
        engine = llm.engine
        # let the worker finish what cancelled streams had in flight, then check the cache
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        blocks = engine.scheduler.blocks
        try:
            blocks.check_invariants()
        except AssertionError as exc:
            errors.append(f"cycle {c}: block invariants: {exc}")
        if blocks.num_free_blocks != blocks.num_usable_blocks:  # free includes unreferenced prefix-cache blocks
            errors.append(f"cycle {c}: {blocks.num_usable_blocks - blocks.num_free_blocks} "
                          "blocks still held after every request ended")
        if llm._pending or llm._live or engine.requests:
            errors.append(f"cycle {c}: leftovers pending={len(llm._pending)} live={len(llm._live)} "
                          f"requests={len(engine.requests)}")
        stats["preemptions"] += engine.stats.preemptions
        llm.shutdown()
        del llm, engine, blocks
        gc.collect()
        if args.trim:
            _malloc_trim()
        stats["cycles"] += 1
        rss = rss_mib()
        rss_samples.append(round(rss, 1))
        if c == 0:
            rss_after_first = rss
        spare = per_cycle_s - (time.monotonic() - tc)
        if spare > 0 and c < cycles - 1:
            time.sleep(spare)
        if errors and len(errors) > 20:
            break
    leftover = [t.name for t in threading.enumerate() if t.ident not in threads_before and t.name == "fxcompiler-engine"]
    if leftover:
        errors.append(f"engine worker threads left: {leftover}")
    final = rss_mib()
    growth = (final - rss_after_first) / rss_after_first
    if growth > args.rss_tolerance:
        errors.append(f"RSS grew {growth:.1%} after the first cycle ({rss_after_first:.0f} -> {final:.0f} MiB)")
    result = {**stats, "seconds": round(time.monotonic() - t0, 1), "rss_after_first_mib": round(rss_after_first, 1),
              "rss_final_mib": round(final, 1), "rss_growth": round(growth, 4), "rss_samples_mib": rss_samples,
              "errors": errors[:20]}
    print(json.dumps(result))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
