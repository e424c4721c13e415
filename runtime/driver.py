"""Runs engine steps on a worker thread, at most ``npu_queue_limit`` steps ahead of the consumer.

furiosa's ``npu_queue_limit`` bounds how many submitted steps may be in flight before
their results are consumed. Here the worker keeps stepping the engine while requests
are unfinished and hands each step's outputs to a queue of that size: a slow consumer
(a streaming client) stalls the engine after ``npu_queue_limit`` steps instead of
letting it run away, and a fast one overlaps its own work (printing, network writes)
with the next step.
"""
from __future__ import annotations

import functools
import queue
import threading

import torch

from fxcompiler.outputs import RequestOutput

from . import openmp_team, worker_threads
from .engine import Engine

_IDLE = object()


class EngineDriver:
    def __init__(self, engine: Engine, queue_limit: int, lock: threading.Lock):
        if queue_limit < 1:
            raise ValueError(f"npu_queue_limit must be >= 1, got {queue_limit}")
        self.engine = engine
        self.lock = lock  # guards the engine: held by the worker during a step and by add/abort
        self.results: queue.Queue = queue.Queue(maxsize=queue_limit)
        self._state = threading.Lock()
        self._running = False
        self._job: worker_threads.Job | None = None  # _serve running on a reusable worker thread
        self._wake = threading.Event()
        self._closed = False  # close(): the worker exits and the engine is released
        self.steps_in_flight_max = 0

    @property
    def running(self) -> bool:
        """Whether the worker thread is stepping the engine (or about to)."""
        with self._state:
            return self._running

    def kick(self) -> None:
        """Make sure the worker runs (call after adding requests, outside the engine lock).

        The worker is one long-lived thread that sleeps while the engine is idle: torch's
        OpenMP team stays with the thread that starts it, so a fresh thread per busy
        period would build a new team (and compete with the old one) each time. For the
        same reason the thread is not the driver's own: it comes from (and goes back to)
        :mod:`runtime.worker_threads`, so the next LLM reuses it."""
        if self._closed:
            raise RuntimeError("the engine driver was closed (LLM.shutdown()); create a new LLM")
        with self._state:
            if not self._running:
                self._running = True
                if self._job is None or not self._job.is_alive():
                    self._job = worker_threads.submit(functools.partial(self._serve, torch.get_num_threads()))
                self._wake.set()

    def _serve(self, threads: int) -> None:
        # A new native thread starts with OpenMP's default team size (OMP_NUM_THREADS), not the
        # creator's torch.set_num_threads(): the fxc kernels would run on fewer cores.
        torch.set_num_threads(threads)
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed or not self._run():
                return
            openmp_team.release()  # idle: the next steps may run inline on a caller's thread

    def _run(self) -> bool:
        """Step until the engine is idle; False after handing an exception to the consumer."""
        try:
            while True:
                if self._closed:
                    break
                with self.lock:
                    if not self.engine.has_unfinished_requests():
                        # Decided under the engine lock: a request added after this point
                        # finds _running False and starts a new worker.
                        with self._state:
                            self._running = False
                        break
                    try:
                        outs: list[RequestOutput] | BaseException = self.engine.step()
                    except BaseException as exc:  # handed to the consumer, which re-raises it
                        outs = exc
                self.results.put(outs)  # blocks while npu_queue_limit steps wait to be consumed
                self.steps_in_flight_max = max(self.steps_in_flight_max, self.results.qsize())
                if isinstance(outs, BaseException):
                    return False
            self.results.put(_IDLE)
            return True
        finally:
            with self._state:
                self._running = False

    def close(self, timeout: float = 10.0) -> bool:
        """Stop the worker (after the step it is computing; its thread goes back to
        :mod:`runtime.worker_threads`) and drop the engine reference, so nothing keeps the engine
        alive; True when the worker has stopped."""
        import time

        self._closed = True
        self._wake.set()
        deadline = time.monotonic() + timeout
        job = self._job
        if job is not None and job.thread is threading.current_thread():  # from the worker: it stops after this step
            return False
        while job is not None and job.is_alive() and time.monotonic() < deadline:
            try:  # a worker blocked handing over a step's outputs gets through
                while True:
                    self.results.get_nowait()
            except queue.Empty:
                pass
            job.join(0.02)
        stopped = job is None or not job.is_alive()
        if stopped:
            self._job = None
            self.engine = None
        return stopped

    def next_outputs(self, timeout: float | None = None) -> list[RequestOutput] | None:
        """The next step's outputs; None when the engine went idle (nothing unfinished)."""
        item = self.results.get(timeout=timeout)
        if item is _IDLE:
            return None
        if isinstance(item, BaseException):
            raise item
        return item
