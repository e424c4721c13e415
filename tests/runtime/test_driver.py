"""EngineDriver: the engine runs at most npu_queue_limit steps ahead of its consumer."""
from __future__ import annotations

import threading
import time

import pytest

from runtime.driver import EngineDriver


class CountingEngine:
    def __init__(self, total: int, fail_at: int | None = None):
        self.total, self.steps, self.fail_at = total, 0, fail_at

    def has_unfinished_requests(self) -> bool:
        return self.steps < self.total

    def step(self):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("step failed")
        return [self.steps]


@pytest.mark.parametrize("limit", [1, 2, 4])
def test_engine_stalls_after_queue_limit_steps(limit):
    engine = CountingEngine(total=20)
    driver = EngineDriver(engine, limit, threading.Lock())
    driver.kick()
    time.sleep(0.3)  # nobody consumes
    assert engine.steps == limit + 1  # `limit` results queued, one more finished and waiting to be queued
    got = []
    while (outs := driver.next_outputs(timeout=5)) is not None:
        got += outs
    assert got == list(range(1, 21))
    engine.total = 25  # new work after the worker went idle: kick starts it again
    driver.kick()
    more = []
    while (outs := driver.next_outputs(timeout=5)) is not None:
        more += outs
    assert more == [21, 22, 23, 24, 25]


def test_step_errors_reach_the_consumer():
    driver = EngineDriver(CountingEngine(total=5, fail_at=3), 2, threading.Lock())
    driver.kick()
    assert driver.next_outputs(timeout=5) == [1]
    assert driver.next_outputs(timeout=5) == [2]
    with pytest.raises(RuntimeError, match="step failed"):
        driver.next_outputs(timeout=5)


def test_queue_limit_must_be_positive():
    with pytest.raises(ValueError, match="npu_queue_limit"):
        EngineDriver(CountingEngine(1), 0, threading.Lock())


def test_one_worker_thread_serves_every_busy_period():
    """The worker sleeps while idle and is reused: OpenMP work stays on one thread."""
    engine = CountingEngine(total=3)
    threads = []
    step = engine.step
    engine.step = lambda: (threads.append(threading.current_thread()), step())[1]
    driver = EngineDriver(engine, 2, threading.Lock())
    for total in (3, 6, 9):
        engine.total = total
        driver.kick()
        while driver.next_outputs(timeout=5) is not None:
            pass
        deadline = time.monotonic() + 5
        while driver.running and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not driver.running
    assert len(threads) == 9 and len(set(threads)) == 1 and threads[0] is not threading.current_thread()
