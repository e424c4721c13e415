"""Build the three C++ extensions of the CPU backend at once, in the background.

``fxc_kernels`` (the linear kernels), ``fxc_paged_attention`` (attention and fused elementwise ops) and
``fxc_graph_program`` (the fx backend's native executor) are each built on first use (``_build``); used one
after the other, a fresh cache paid their g++ times in series, on the critical path of the first
``LLM(...)``. :func:`start` builds (or just loads, when cached) all three in daemon threads, each under its
own ``flock`` and ``load_once`` lock, while the caller goes on exporting the model: a later first use
waits for the build already running instead of starting one. ``torch.utils.cpp_extension`` runs the
compiler as a subprocess, so the threads do not hold the GIL while g++ runs.

``fxcompiler/build.py`` calls :func:`start` when it compiles a program for the CPU; ``scripts/setup_env.sh``
calls :func:`build_all` at install time, so a fresh clone's first run finds the libraries built.
``FXCOMPILER_PREBUILD=0`` turns the background start off (builds then happen at first use, in series).
"""
from __future__ import annotations

import os
import threading
import time

_started: list[threading.Thread] = []
_lock = threading.Lock()
timings: dict[str, float] = {}  # extension -> seconds its build/load took (for the start-up benchmark)


def _linear() -> bool:
    from . import _build

    return _build.ensure_loaded()


def _attention() -> bool:
    from . import attention

    return attention.kernel_module() is not None


def _graph_program() -> bool:
    from .. import graph_program

    return graph_program.enabled() and graph_program.program_module() is not None


TASKS = {"fxc_kernels": _linear, "fxc_paged_attention": _attention, "fxc_graph_program": _graph_program}


def enabled() -> bool:
    return os.environ.get("FXCOMPILER_PREBUILD", "1").strip().lower() not in ("0", "false", "off", "no")


def _run(name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        fn()  # failures are recorded (and warned about once) by the loaders themselves
    finally:
        timings[name] = time.perf_counter() - t0


def start() -> list[threading.Thread]:
    """Start building/loading the extensions in daemon threads (once per process); returns the threads."""
    with _lock:
        if not _started and enabled():
            for name, fn in TASKS.items():
                t = threading.Thread(target=_run, args=(name, fn), name=f"fxc-prebuild-{name}", daemon=True)
                t.start()
                _started.append(t)
        return list(_started)


def build_all() -> dict[str, bool]:
    """Build (or load) the three extensions in parallel and wait; name -> whether it is usable."""
    results: dict[str, bool] = {}

    def run(name, fn):
        t0 = time.perf_counter()
        try:
            results[name] = bool(fn())
        finally:
            timings[name] = time.perf_counter() - t0

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in TASKS.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


if __name__ == "__main__":  # python -m backends.cpu.prebuild  (scripts/setup_env.sh)
    t0 = time.perf_counter()
    res = build_all()
    print("fxcompiler C++ extensions: " + ", ".join(f"{k} {'ok' if v else 'unavailable'} ({timings[k]:.0f}s)"
                                                  for k, v in res.items()) + f"; {time.perf_counter() - t0:.0f}s")
