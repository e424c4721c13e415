"""LLM create -> generate -> stream -> shutdown cycles leave nothing behind: no Python objects,
no torch.fx graph sources (``linecache``), no threads, no RSS growth (scripts/soak.py's long
form of this check)."""
from __future__ import annotations

import asyncio
import ctypes
import gc
import linecache
import os
import threading

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


def _cycle(llama_dir, cache) -> list:
    llm = make_llm(llama_dir, cache)
    out = [o.outputs[0].token_ids for o in llm.generate(None, SP, prompt_token_ids=PROMPTS)]

    async def stream():  # starts the engine's worker thread
        return [d async for d in llm.stream_generate("", SP, prompt_token_ids=PROMPTS[0])]

    asyncio.run(stream())
    llm.shutdown()
    del llm
    gc.collect()
    return out


def _state() -> dict:
    return {"objects": len(gc.get_objects()), "linecache": len(linecache.cache),
            "fx_sources": len(_loader.eval_cache), "threads": threading.active_count(), "rss_mib": _rss_mib()}


def test_create_shutdown_cycles_leave_nothing_behind(llama_dir, rel_cache):
    want = _cycle(llama_dir, rel_cache)  # warm-up: caches filled, the sources of older graphs released
    _cycle(llama_dir, rel_cache)
    before = _state()
    for _ in range(CYCLES):
        assert _cycle(llama_dir, rel_cache) == want
    after = _state()
    assert after["linecache"] == before["linecache"] and after["fx_sources"] == before["fx_sources"], (before, after)
    assert after["threads"] == before["threads"], (before, after)
    assert after["objects"] - before["objects"] <= CYCLES, (before, after)  # one leaked LLM is thousands
    assert after["rss_mib"] - before["rss_mib"] < RSS_GROWTH_MIB, (before, after)
