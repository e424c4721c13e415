"""Engine worker threads, reused from one ``EngineDriver`` (one ``LLM``) to the next.

A thread that runs torch work builds native state of its own: its OpenMP team (more threads;
released when a job ends, :mod:`runtime.openmp_team`), MKL's per-thread sgemm buffers (about 4 MiB
each, ``mkl_serv_allocate``) and a glibc malloc arena, from which allocations that outlive the
thread (caches, the next LLM's objects) are also served and pin its pages. Starting a fresh worker
thread per ``LLM`` made a process that creates and shuts down LLMs in a loop grow by ~1.5-2 MiB of
RSS per LLM with flat Python memory (scripts/soak.py, docs/security.md). So a worker whose job has
ended does not exit: it waits, named ``fxcompiler-engine-idle``, for the next driver to hand it a
job, and the state it built is reused instead of leaked. At most :data:`MAX_IDLE` workers wait; more
exit.

The threads that wait for a stream's next outputs (``LLM.stream_generate``) are likewise one
process-wide pool (:func:`stream_waiters`), not the event loop's default executor, whose threads
are created anew for every loop (every ``asyncio.run``) and each take a malloc arena.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
from typing import Callable

from . import openmp_team

__all__ = ["BUSY_NAME", "IDLE_NAME", "MAX_IDLE", "Job", "idle_count", "stream_waiters", "submit"]

log = logging.getLogger("fxcompiler")

BUSY_NAME = "fxcompiler-engine"  # a worker running a driver's job
IDLE_NAME = "fxcompiler-engine-idle"  # a worker waiting for the next job
MAX_IDLE = 4  # idle workers kept (one per LLM that may be live at once is the useful number)

_lock = threading.Lock()
_idle: list["_Worker"] = []
_waiters: concurrent.futures.ThreadPoolExecutor | None = None


class Job:
    """One function running on a worker thread; ``is_alive``/``join`` as for the thread it replaces."""

    def __init__(self, fn: Callable[[], None], thread: threading.Thread):
        self.fn = fn
        self.thread = thread
        self._done = threading.Event()

    def is_alive(self) -> bool:
        """True until the function has returned (or raised)."""
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` seconds) for the function to end; True when it has."""
        return self._done.wait(timeout)


class _Worker(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name=BUSY_NAME, daemon=True)
        self.jobs: "queue.SimpleQueue[Job]" = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                job.fn()
            except BaseException:  # noqa: BLE001 - a job's failure must not kill a reusable worker
                log.exception("engine worker job failed")
            finally:
                openmp_team.release()  # an idle worker holds no OpenMP team (runtime.openmp_team)
                self.name = IDLE_NAME
                with _lock:
                    keep = len(_idle) < MAX_IDLE
                    if keep:
                        _idle.append(self)
                job.fn = None  # drop the job's references (the driver and its engine) before waiting
                job._done.set()
            if not keep:
                return


def submit(fn: Callable[[], None]) -> Job:
    """Run ``fn`` on an idle worker thread, or on a new one when none is idle."""
    with _lock:
        worker = _idle.pop() if _idle else None
    if worker is None:
        worker = _Worker()
        job = Job(fn, worker)
        worker.jobs.put(job)
        worker.start()
    else:
        worker.name = BUSY_NAME
        job = Job(fn, worker)
        worker.jobs.put(job)
    return job


def idle_count() -> int:
    """How many workers wait for a job."""
    with _lock:
        return len(_idle)


def stream_waiters() -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide executor on which streams wait for engine outputs (sized as asyncio's default).

    All its threads are started at once: a ThreadPoolExecutor otherwise adds a thread whenever a
    task is submitted a moment before the previous one's thread has marked itself idle, so how
    many threads it holds (and when the next one starts) would depend on timing."""
    global _waiters
    with _lock:
        if _waiters is None:
            size = min(32, (os.cpu_count() or 1) + 4)
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=size, thread_name_prefix="fxcompiler-stream")
            all_started = threading.Barrier(size)
            # a broken barrier (threads not all started within 30 s) only leaves the pool growing lazily
            concurrent.futures.wait([pool.submit(all_started.wait, 30) for _ in range(size)])
            _waiters = pool
        return _waiters
