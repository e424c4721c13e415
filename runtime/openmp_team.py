"""One OpenMP team at a time: a thread that stops running model forwards releases its team.

torch's OpenMP runtime (libgomp, shipped in ``torch/lib``) gives every thread that enters a
parallel region a team of its own, and the team's threads live as long as that thread. Once the
process holds more team threads than CPUs, libgomp throttles the spinning waits of *every* team
(``gomp_throttled_spin_count``): threads sleep on a futex at each barrier instead of spinning,
and every forward runs ~20 % slower (10-20x the voluntary context switches; docs/serving.md). An
``LLM`` is built on one thread and may be stepped on another (the driver's worker for streams, the
engine thread of a server), so each thread that is done stepping calls :func:`release`.

OpenMP 5.0's ``omp_pause_resource_all(omp_pause_soft)`` frees the calling thread's team (libgomp
and LLVM's libomp both have it); the next parallel region on that thread builds a new one (one
``pthread_create`` per team thread, tens of microseconds). Without such a runtime this is a no-op,
as with ``FXCOMPILER_OPENMP_RELEASE=0`` (for A/B measurements).
"""
from __future__ import annotations

import ctypes
import glob
import os
import threading

__all__ = ["available", "release"]

_OMP_PAUSE_SOFT = 1
_lock = threading.Lock()
_pause = None  # omp_pause_resource_all of the runtime torch loaded, once looked up; False: none


def _lookup():
    global _pause
    with _lock:
        if _pause is None:
            _pause = False
            import torch

            libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
            # the copy torch loaded (dlopen of the same path returns the loaded library)
            for path in sorted(glob.glob(os.path.join(libdir, "libgomp*.so*")) +
                               glob.glob(os.path.join(libdir, "libiomp*.so*")) +
                               glob.glob(os.path.join(libdir, "libomp*.so*"))):
                try:
                    fn = ctypes.CDLL(path).omp_pause_resource_all
                except (OSError, AttributeError):
                    continue
                fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
                _pause = fn
                break
        return _pause


def available() -> bool:
    """Whether the OpenMP runtime torch uses can release a thread's team (and releasing is not switched off)."""
    return os.environ.get("FXCOMPILER_OPENMP_RELEASE", "1") != "0" and bool(_lookup())


def release() -> bool:
    """Free the calling thread's OpenMP team (call when it stops running forwards); True when freed."""
    if os.environ.get("FXCOMPILER_OPENMP_RELEASE", "1") == "0":
        return False
    fn = _lookup()
    return bool(fn) and fn(_OMP_PAUSE_SOFT) == 0
