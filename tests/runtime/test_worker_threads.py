"""Engine worker threads run the kernels on the creator's ``torch.set_num_threads`` team size, not on
OpenMP's default for a new native thread (``OMP_NUM_THREADS``): the stream worker of ``LLM`` and the
engine thread of ``AsyncLLMEngine``."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
