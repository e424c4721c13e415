"""LLM create -> generate -> stream -> shutdown cycles leave nothing behind: no Python objects,
no torch.fx graph sources (``linecache``), no threads, no RSS growth (scripts/soak.py's long
form of this check)."""
from __future__ import annotations

import asyncio
import ctypes
import gc
import linecache
import logging
import os
import threading
import time

from torch.fx.graph_module import _loader

from fxcompiler import SamplingParams

from .conftest import PROMPTS, make_llm

SP = SamplingParams(max_tokens=6, temperature=0)
CYCLES = 5
# A coarse bound, well above the RSS noise between cycles (about ±3 MiB in probes of these cycles);
# the exact checks are the object, linecache and thread counts (one LLM left behind is thousands of objects).
RSS_GROWTH_MIB = 8.0


def _rss_mib() -> float:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap glibc keeps is not a leak
    except (OSError, AttributeError):
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _cycle(llama_dir, cache, seen: set | None = None) -> list:
    """One LLM created, used and shut down; ``seen`` collects the Python threads alive after its stream
    (their native ids)."""
    llm = make_llm(llama_dir, cache)
    out = [o.outputs[0].token_ids for o in llm.generate(None, SP, prompt_token_ids=PROMPTS)]

    async def stream():  # starts the engine's worker thread
        deltas = [d async for d in llm.stream_generate("", SP, prompt_token_ids=PROMPTS[0])]
        if seen is not None:
            # not the huge-page thread each LLM starts, which ends by itself (tests/backends/cpu/test_huge_pages.py)
            seen.update(t.native_id for t in threading.enumerate() if t.name != "fxcompiler-huge-pages")
        return deltas

    asyncio.run(stream())
    llm.shutdown()
    del llm
    gc.collect()
    return out


def _state() -> dict:
    objects = len(gc.get_objects())
    return {"objects": objects, "linecache": len(linecache.cache),
            "fx_sources": len(_loader.eval_cache), "threads": threading.active_count(), "rss_mib": _rss_mib()}


def test_create_shutdown_cycles_leave_nothing_behind(llama_dir, rel_cache):
    want = _cycle(llama_dir, rel_cache)  # warm-up: caches filled, the sources of older graphs released
    _cycle(llama_dir, rel_cache)
    # pytest's log capture keeps every LogRecord with its arguments (each cycle logs "no tokenizer
    # found"; where torch's structured trace log propagates, every export logs nested metadata dicts,
    # 140 000 objects in 5 cycles): none is the LLM's, so none is made while the objects are counted
    logging.disable(logging.CRITICAL)
    try:
        before = _state()
        for _ in range(CYCLES):
            assert _cycle(llama_dir, rel_cache) == want
        after = _state()
    finally:
        logging.disable(logging.NOTSET)
    assert after["linecache"] == before["linecache"] and after["fx_sources"] == before["fx_sources"], (before, after)
    assert after["threads"] == before["threads"], (before, after)
    assert after["objects"] - before["objects"] <= CYCLES, (before, after)  # one leaked LLM is thousands
    assert after["rss_mib"] - before["rss_mib"] < RSS_GROWTH_MIB, (before, after)


def _os_threads_settled(at_most: int, timeout: float = 5.0) -> int:
    """OS threads alive (Python's, OpenMP's, MKL's) once those ending have gone, or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (n := len(os.listdir("/proc/self/task"))) > at_most and time.monotonic() < deadline:
        time.sleep(0.01)
    return n


def test_cycles_start_no_thread_per_llm(llama_dir, rel_cache):
    """Each LLM's engine worker and the threads streams wait on are reused by the next LLM: a fresh set per
    LLM took ~1.5-2 MiB of native memory each time (malloc arenas, per-thread MKL state), scripts/soak.py's
    RSS growth. OpenMP's team threads end instead: a thread that stops stepping releases its team
    (runtime.openmp_team; two live teams throttle every forward) and its next parallel region starts a new
    one, so their ids change from cycle to cycle but their number does not grow (RSS: the test above)."""
    warm: set[int] = set()
    _cycle(llama_dir, rel_cache, warm)
    _cycle(llama_dir, rel_cache, warm)
    idle = _os_threads_settled(0, timeout=1.0)  # after the warm-up: the most that may stay between LLMs
    seen: set[int] = set()
    for i in range(CYCLES):
        _cycle(llama_dir, rel_cache, seen)
        left = _os_threads_settled(idle)
        assert left <= idle, f"cycle {i}: {left} OS threads stay after the LLM's shutdown, {idle} after the warm-up"
    started = seen - warm
    assert not started, f"{len(started)} Python threads started by {CYCLES} LLM cycles after the warm-up"
