"""Engine worker threads, reused from one ``EngineDriver`` (one ``LLM``) to the next.

A thread that runs torch work builds native state of its own: its OpenMP team (more threads),
MKL's per-thread sgemm buffers (about 4 MiB each, ``mkl_serv_allocate``) and a glibc malloc
arena, from which allocations that outlive the thread (caches, the next LLM's objects) are also
served and pin its pages. Starting a fresh worker thread per ``LLM`` made a process that creates
and shuts down LLMs in a loop grow by ~1.5-2 MiB of RSS per LLM with flat Python memory
(scripts/soak.py, docs/security.md). So a worker whose job has ended does not exit: it waits, named
``fxcompiler-engine-idle``, for the next driver to hand it a job, and the state it built is
reused instead of leaked. At most :data:`MAX_IDLE` workers wait; more exit.

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
from typing import Any, Callable

__all__ = ["BUSY_NAME", "IDLE_NAME", "MAX_IDLE", "Job", "call", "idle_count", "stream_waiters", "submit"]

log = logging.getLogger("fxcompiler")

BUSY_NAME = "fxcompiler-engine"  # a worker running a driver's job
IDLE_NAME = "fxcompiler-engine-idle"  # a worker waiting for the next job
MAX_IDLE = 4  # idle workers kept (one per LLM that may be live at once is the useful number)

_lock = threading.Lock()
_idle: list["_Worker"] = []
_waiters: concurrent.futures.ThreadPoolExecutor | None = None


class Job:
    """One function running on a worker thread; ``is_alive``/``join`` as for the thread it replaces."""

    def __init__(self, fn: Callable[[], Any], thread: threading.Thread, reraised: bool = False):
        self.fn = fn
        self.thread = thread
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self.reraised = reraised  # result() hands the exception to a caller: the worker does not log it

    def is_alive(self) -> bool:
        """True until the function has returned (or raised)."""
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` seconds) for the function to end; True when it has."""
        return self._done.wait(timeout)

    def result(self) -> Any:
        """Wait for the function to end; its return value, or the exception it raised, re-raised here."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


class _Worker(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name=BUSY_NAME, daemon=True)
        self.jobs: "queue.SimpleQueue[Job]" = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                job._value = job.fn()
            except BaseException as exc:  # noqa: BLE001 - a job's failure must not kill a reusable worker
                job._error = exc
                if not job.reraised:
                    log.exception("engine worker job failed")
            finally:
                self.name = IDLE_NAME
                with _lock:
                    keep = len(_idle) < MAX_IDLE
                    if keep:
                        _idle.append(self)
                job.fn = None  # drop the job's references (the driver and its engine) before waiting
                job._done.set()
            if not keep:
                return


def submit(fn: Callable[[], Any], prefer: threading.Thread | None = None, *, reraise: bool = False) -> Job:
    """Run ``fn`` on an idle worker thread, or on a new one when none is idle.

    ``prefer``: a worker to take when it is idle (the one that built a model, whose OpenMP team
    should also run the model's steps: :func:`call`). ``reraise``: the caller collects an exception
    with ``Job.result()``, so the worker does not log it."""
    with _lock:
        if prefer is not None and prefer in _idle:
            _idle.remove(prefer)
            worker = prefer
        else:
            worker = _idle.pop() if _idle else None
    fresh = worker is None
    if fresh:
        worker = _Worker()
    else:
        worker.name = BUSY_NAME
    job = Job(fn, worker, reraise)
    worker.jobs.put(job)
    if fresh:
        worker.start()
    return job


def call(fn: Callable[[], Any]) -> tuple[Any, threading.Thread]:
    """Run ``fn`` on a worker, wait, and return its value and the worker (or raise what it raised).

    For building a model whose steps a worker will run later (``submit(..., prefer=thread)``):
    torch's OpenMP team belongs to the thread that first enters a parallel region, and a second
    team in the process (the build's on this thread, the steps' on a worker) makes libgomp throttle
    its spinning waits once the teams' threads outnumber the CPUs; every forward then runs ~20 %
    slower (docs/serving.md). Building on the stepping thread keeps the process at one team."""
    job = submit(fn, reraise=True)
    try:
        return job.result(), job.thread
    finally:  # the idle worker keeps its last job object: it must not keep the value alive
        job._value = job._error = None


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
