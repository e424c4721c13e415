"""Engine worker threads run the kernels on the creator's ``torch.set_num_threads`` team size, not on
OpenMP's default for a new native thread (``OMP_NUM_THREADS``): the stream worker of ``LLM`` and the
engine thread of ``AsyncLLMEngine``. The stream workers are reused from one driver to the next
(``runtime.worker_threads``)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from runtime import worker_threads
from runtime.driver import EngineDriver

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import asyncio, ctypes, glob, os, threading
import torch
gomp = ctypes.CDLL(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*"))[0])
torch.set_num_threads(2)
seen = {}

class Engine:  # the driver's and the async engine's view of an engine: steps until nothing is left
    def __init__(self, name):
        self.name, self.left, self.requests = name, 1, {}
    def has_unfinished_requests(self):
        return self.left > 0
    def step(self):
        seen[self.name] = gomp.omp_get_max_threads()
        self.left -= 1
        return []

from runtime.driver import EngineDriver
d = EngineDriver(Engine("driver"), 2, threading.Lock())
d.kick()
import time
deadline = time.monotonic() + 10
while "driver" not in seen and time.monotonic() < deadline:
    time.sleep(0.01)
d.close()

from fxcompiler.serving.engine import AsyncLLMEngine

class LLMEngineStub:
    owns_llm = False

    def __init__(self):
        self.engine = Engine("async")
        self._lock = threading.Lock()
    def has_unfinished_requests(self):
        return self.engine.has_unfinished_requests()
    def step(self):
        return self.engine.step()
    def abort_request(self, ids):
        pass

async def main():
    a = AsyncLLMEngine(LLMEngineStub())
    a._ensure_started()
    a._wake.set()
    for _ in range(1000):
        if "async" in seen:
            break
        await asyncio.sleep(0.01)
    a.shutdown()

asyncio.run(main())
print(seen["driver"], seen["async"], gomp.omp_get_max_threads())
"""


def test_worker_threads_keep_the_creators_thread_count():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2", "2", "2"], out.stdout


class _OneStep:
    def __init__(self, seen: list):
        self.left, self.seen = 1, seen

    def has_unfinished_requests(self) -> bool:
        return self.left > 0

    def step(self):
        self.seen.append(threading.current_thread())
        self.left -= 1
        return []


def _drive_once(seen: list) -> None:
    driver = EngineDriver(_OneStep(seen), 2, threading.Lock())
    driver.kick()
    while driver.next_outputs(timeout=5) is not None:
        pass
    assert driver.close(5)


def test_the_next_driver_reuses_the_worker_thread():
    seen: list[threading.Thread] = []
    for _ in range(4):
        _drive_once(seen)
        assert seen[-1].name == worker_threads.IDLE_NAME and seen[-1].is_alive()
    assert len(seen) == 4 and len(set(seen)) == 1, "each driver started its own thread"


def test_a_busy_worker_is_named_and_idle_workers_are_bounded():
    release = threading.Event()
    started = threading.Semaphore(0)

    def job():
        assert threading.current_thread().name == worker_threads.BUSY_NAME
        started.release()
        release.wait(10)

    jobs = [worker_threads.submit(job) for _ in range(worker_threads.MAX_IDLE + 2)]
    for _ in jobs:
        assert started.acquire(timeout=10)
    assert len({j.thread for j in jobs}) == len(jobs)  # none idle while all are busy: new threads
    release.set()
    for j in jobs:
        assert j.join(10)
    deadline = time.monotonic() + 10
    while any(j.thread.is_alive() for j in jobs[worker_threads.MAX_IDLE:]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker_threads.idle_count() == worker_threads.MAX_IDLE
    assert sum(j.thread.is_alive() for j in jobs) == worker_threads.MAX_IDLE


def test_a_failing_job_leaves_the_worker_usable_and_drops_its_references():
    def boom():
        raise RuntimeError("job failed")

    first = worker_threads.submit(boom)
    assert first.join(10) and first.fn is None
    ran = []
    second = worker_threads.submit(lambda: ran.append(threading.current_thread()))
    assert second.join(10) and ran == [first.thread] and second.fn is None


def test_streams_wait_on_one_process_wide_executor_of_fixed_size():
    pool = worker_threads.stream_waiters()
    assert worker_threads.stream_waiters() is pool
    size = len(pool._threads)
    assert size == min(32, (os.cpu_count() or 1) + 4)  # all started at once, not as timing has it
    for _ in range(100):
        pool.submit(lambda: None).result()
    assert len(pool._threads) == size


class _AsyncEngineStub:  # the AsyncLLMEngine's view of an LLMEngine
    owns_llm = False

    def __init__(self, seen: list):
        self.engine = _OneStep(seen)
        self.engine.requests = {}
        self._lock = threading.Lock()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self):
        return self.engine.step()

    def abort_request(self, ids) -> None:
        pass


def test_async_engines_run_on_reused_worker_threads():
    import asyncio

    from fxcompiler.serving.engine import AsyncLLMEngine

    seen: list[threading.Thread] = []

    async def serve_once() -> None:
        engine = AsyncLLMEngine(_AsyncEngineStub(seen))
        engine._ensure_started()
        engine._wake.set()
        for _ in range(1000):
            if len(seen) == n + 1:
                break
            await asyncio.sleep(0.01)
        assert engine.is_running
        engine.shutdown(10)
        assert not engine.is_running

    for n in range(3):
        asyncio.run(serve_once())
        assert seen[-1].name == worker_threads.IDLE_NAME and seen[-1].is_alive()
    assert len(seen) == 3 and len(set(seen)) == 1, "each AsyncLLMEngine started its own thread"
