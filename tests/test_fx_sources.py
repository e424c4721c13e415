"""fxcompiler.fx_sources: torch.fx's cached graph sources are dropped once their function is gone,
never while it lives."""
from __future__ import annotations

import gc
import linecache
import threading
import types

import torch
from torch.fx.graph_module import _loader

from fxcompiler.fx_sources import release_dead_sources


class _Net(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) + 1


def _key(gm: torch.fx.GraphModule) -> str:
    return type(gm).forward.__code__.co_filename


def test_sources_of_dead_graphs_are_dropped_and_live_ones_kept():
    live, dead = torch.fx.symbolic_trace(_Net()), torch.fx.symbolic_trace(_Net())
    keys = {"live": _key(live), "dead": _key(dead)}
    assert all(k in _loader.eval_cache and k in linecache.cache for k in keys.values())
    release_dead_sources()  # keys newer than the previous call are only considered from the next one
    del dead
    gc.collect()
    release_dead_sources()
    assert keys["dead"] not in _loader.eval_cache and keys["dead"] not in linecache.cache
    assert keys["live"] in _loader.eval_cache and keys["live"] in linecache.cache
    assert "relu" in "".join(linecache.getlines(keys["live"]))  # tracebacks still show its code
    x = torch.randn(3)
    torch.testing.assert_close(live(x), torch.relu(x) + 1)


def test_a_key_newer_than_the_previous_call_is_left_for_the_next():
    release_dead_sources()
    gm = torch.fx.symbolic_trace(_Net())
    key = _key(gm)
    del gm
    gc.collect()
    release_dead_sources()  # its function might still be being created by another thread
    assert key in _loader.eval_cache
    release_dead_sources()
    assert key not in _loader.eval_cache


def test_a_finaliser_calling_it_during_its_scan_does_not_deadlock(monkeypatch):
    """The scan allocates, so a garbage collection can run inside it and finalise an LLM whose
    ``__del__`` calls release_dead_sources again in the same thread: it returns instead of waiting."""
    from fxcompiler import fx_sources

    inner = []

    class Finalised:
        def __del__(self):
            inner.append(release_dead_sources())

    def get_objects_collecting():
        cycle = Finalised()
        cycle.self = cycle
        del cycle
        gc.collect()  # what an allocation inside the scan may trigger
        return gc.get_objects()

    monkeypatch.setattr(fx_sources, "gc", types.SimpleNamespace(get_objects=get_objects_collecting))
    release_dead_sources()
    torch.fx.symbolic_trace(_Net())  # an old key for the next call, so it scans
    release_dead_sources()
    t = threading.Thread(target=release_dead_sources, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "release_dead_sources deadlocked on its own lock"
    assert inner and all(n == 0 for n in inner)
