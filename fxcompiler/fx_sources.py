"""The generated source torch.fx keeps for every graph function: dropped once the function is gone.

``GraphModule.recompile()`` and ``torch.fx.graph_module._forward_from_src`` (which loading a
graph from a cache uses) store the source of each ``forward`` they compile in torch.fx's loader
(``_loader.eval_cache``) and register a lazy ``linecache`` entry for it under a fresh
``<eval_with_key>.N`` name, so tracebacks can show graph code. Nothing ever removes them: every
``LLM`` built in a process added its graphs' sources for good (two entries per graph loaded from
the build cache, one per recompile while building), and those small records, allocated among
the graph objects that were freed, also kept the allocator from returning their pages.

:func:`release_dead_sources` drops the entries whose function no longer exists (no live
function object was compiled from them); ``LLM.shutdown()`` calls it. Only numbered keys are
considered, and only those that already existed at the previous call: a key is cached just
before its function is created, so a newer one may belong to a graph another thread is
compiling right now.

A call finds the lock taken when another call is running, in another thread or in this one: a
garbage collection triggered inside the scan can finalise an ``LLM``, whose ``__del__`` shuts it
down and calls this again. It then returns at once (the running call does the work) instead of
waiting for a lock its own thread holds.
"""
from __future__ import annotations

import gc
import linecache
import re
import threading
import types

_KEY = re.compile(r"<eval_with_key>\.(\d+)")
_lock = threading.Lock()
_watermark = 0  # torch.fx's next key number at the previous call


def release_dead_sources() -> int:
    """Drop torch.fx's cached sources (and ``linecache`` entries) of graph functions that no
    longer exist; returns how many were dropped."""
    global _watermark
    from torch.fx.graph_module import _loader

    if not _lock.acquire(blocking=False):
        return 0
    try:
        limit, _watermark = _watermark, _loader.next_id
        old = [k for k in list(_loader.eval_cache) if (m := _KEY.match(k)) and int(m.group(1)) < limit]
        if not old:
            return 0
        live = {o.__code__.co_filename for o in gc.get_objects() if type(o) is types.FunctionType}
        dead = [k for k in old if k not in live]
        for k in dead:
            _loader.eval_cache.pop(k, None)
            linecache.cache.pop(k, None)
        return len(dead)
    finally:
        _lock.release()
