"""LLM lifecycle: shut an LLM's engine down exactly once (explicitly, on garbage collection, at exit).

An LLM that streamed owns a worker thread stepping its engine. The thread references the
engine, not the LLM, so dropping the LLM runs its ``__del__``, which stops the thread and lets
the engine (KV cache, executables) go; :func:`shutdown` is that step, idempotent and safe on a
half-constructed object. Live LLMs are tracked weakly so interpreter exit stops their workers
before the runtime tears down the modules they use.
"""
from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any

log = logging.getLogger("fxcompiler")

_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register(llm: Any) -> None:
    """Track ``llm`` (weakly) so it is shut down at interpreter exit."""
    _LIVE.add(llm)


def shutdown(llm: Any, timeout: float = 10.0, release_sources: bool = True, finalizing: bool = False) -> None:
    """Abort ``llm``'s requests, stop its driver's worker thread and release its engine (and the
    graph sources torch.fx still keeps for graphs that are gone: :mod:`fxcompiler.fx_sources`).

    ``finalizing``: called from ``__del__``, which a garbage collection runs in whatever thread
    allocated, possibly the engine's own worker in the middle of a step, holding the engine lock.
    Waiting for that lock would never end, so a finaliser aborts the requests only when the lock
    is free; otherwise the worker stops after its step and the engine goes with it."""
    if llm.__dict__.get("_shut_down", False):
        return
    llm.__dict__["_shut_down"] = True
    driver = llm.__dict__.get("_driver")
    engine = llm.__dict__.get("engine")
    lock = llm.__dict__.get("_lock")
    if engine is not None and lock is not None and lock.acquire(blocking=not finalizing):
        try:
            for rid in list(getattr(engine, "requests", {})):
                engine.abort_request(rid)
        finally:
            lock.release()
    if driver is not None and not driver.close(timeout):
        log.warning("the engine worker of %r did not stop within %.0fs (a step still running)", llm, timeout)
    llm.__dict__["_driver"] = None
    llm.__dict__["engine"] = None
    pending = llm.__dict__.get("_pending")
    if pending is not None:
        pending.clear()
    live = llm.__dict__.get("_live")
    if live is not None:
        live.clear()
    workers = llm.__dict__.get("_workers")  # a parallel plan's rank workers / replicas: reaped here
    if workers is not None:
        workers.shutdown()
    draft = llm.__dict__.pop("_owned_draft", None)  # a parallel draft built for this LLM: its rank workers
    if draft is not None:
        shutdown(draft, timeout, release_sources=False, finalizing=finalizing)
    _LIVE.discard(llm)
    if release_sources:
        from .fx_sources import release_dead_sources

        release_dead_sources()


@atexit.register
def _shutdown_all() -> None:
    for llm in list(_LIVE):
        try:
            shutdown(llm, timeout=2.0, release_sources=False)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
