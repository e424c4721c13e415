"""A thread that stops stepping an engine releases its OpenMP team (``runtime.openmp_team``): the build's
thread, an idle driver worker, a worker whose job ended. Two live teams with more threads than CPUs put
libgomp in its throttled-spinning state for every forward (docs/serving.md)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Counted in a fresh process: the only threads that come and go in it are the ones the checks start.
CHILD = r"""
import os, threading, time
import torch
from runtime import openmp_team, worker_threads
from runtime.driver import EngineDriver

torch.set_num_threads(2)
x = torch.randn(1 << 22)

def ntask():
    return len(os.listdir("/proc/self/task"))

def settled(want, timeout=5.0):  # threads that exit leave /proc a moment later
    deadline = time.monotonic() + timeout
    while ntask() != want and time.monotonic() < deadline:
        time.sleep(0.005)
    return ntask()

def forward():
    torch.nn.functional.silu(x)  # a parallel region on this thread: its team of 2 (this thread + 1)

print("available", openmp_team.available())
base = ntask()
forward()
print("main team", ntask() - base)
print("released", openmp_team.release(), settled(base) - base)
print("release without a team", openmp_team.release())

job = worker_threads.submit(forward)
job.join(10)
print("worker job ended", settled(base + 1) - base)  # the idle worker stays, its team does not

class Engine:
    def __init__(self):
        self.left = 3
    def has_unfinished_requests(self):
        return self.left > 0
    def step(self):
        forward()
        self.left -= 1
        return []

driver = EngineDriver(Engine(), 2, threading.Lock())
driver.kick()
while driver.next_outputs(timeout=10) is not None:
    pass
print("driver idle", settled(base + 1) - base)  # its worker waits for the next kick without a team
assert driver.close(10)
"""


def test_threads_that_stop_stepping_release_their_openmp_team():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines == ["available True", "main team 1", "released True 0", "release without a team True",
                     "worker job ended 1", "driver idle 1"], out.stdout


def test_releasing_can_be_switched_off_for_ab_measurements(monkeypatch):
    from runtime import openmp_team

    monkeypatch.setenv("FXCOMPILER_OPENMP_RELEASE", "0")
    assert openmp_team.available() is False and openmp_team.release() is False
