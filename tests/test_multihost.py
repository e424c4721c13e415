"""fxcompiler/multihost.py's pure parts: the rank layout, refused worlds, and how rank 0's watch
names the failed rank, the abortable CPU collectives (the end-to-end torchrun runs are in
tests/test_parallel.py)."""
from __future__ import annotations

import time

import pytest

from fxcompiler.mppp import ParallelPlan, PlanError
from fxcompiler.multihost import DEAD_AFTER_S, HEARTBEAT_S, TorchrunPeers, _Staleness, check_world, replica_logits_rank


def test_replica_logits_rank_is_tp_rank_0_of_the_replica_s_last_stage():
    plan = ParallelPlan(tp=2, pp=2, dp=3)  # ranks [dp][pp][tp]: replica d is 4d .. 4d + 3
    assert [replica_logits_rank(plan, d) for d in range(3)] == [2, 6, 10]
    assert [replica_logits_rank(ParallelPlan(tp=2, dp=2), d) for d in range(2)] == [0, 2]


def test_worlds_other_than_dp_pp_tp_are_refused_naming_the_sizes():
    check_world(ParallelPlan(tp=2, pp=2, dp=2), 8)
    with pytest.raises(PlanError, match=r"torchrun started 8 ranks but tensor_parallel_size=2 × pipeline_parallel_size"
                                        r"=2 × data_parallel_size=1 needs 4; with these tp and pp pass "
                                        r"data_parallel_size=2"):
        check_world(ParallelPlan(tp=2, pp=2), 8)
    with pytest.raises(PlanError, match=r"started 6 ranks but .*=1 × data_parallel_size=1 needs 4$"):
        check_world(ParallelPlan(tp=4), 6)  # 6 is no multiple of tp × pp: no data_parallel_size fits


def test_staleness_counts_the_time_a_heartbeat_stood_still():
    st = _Staleness([1, 2])
    st.update({1: b"1", 2: b"1"})
    time.sleep(0.05)
    ages = st.update({1: b"2", 2: b"1"})
    assert ages[1] < 0.01 and ages[2] >= 0.05


def _peers(world: int) -> TorchrunPeers:
    p = object.__new__(TorchrunPeers)  # the watch's bookkeeping only, no store
    p.infos = [f"h{r} pid {100 + r}" for r in range(world)]
    p._reports, p._first_report = {}, None
    return p


def test_a_silent_rank_is_named_before_ranks_whose_collectives_then_failed():
    p = _peers(4)
    p._reports = {2: (1, "raised RuntimeError: Connection closed by peer")}  # a consequence, reported first
    p._first_report = time.monotonic()
    v = p._verdict({1: 0.1, 2: DEAD_AFTER_S + 1, 3: DEAD_AFTER_S + 0.5})
    assert v.startswith(f"rank 3 (h3 pid 103) stopped its heartbeat {DEAD_AFTER_S + 0.5:.1f} s ago: it died")
    assert p._verdict({1: 0.1, 2: 0.1, 3: 0.1}) is None  # within the grace: a silent death may still show


def test_without_a_silent_death_the_first_report_is_named_after_the_grace():
    p = _peers(4)
    p._reports = {3: (2, "raised RuntimeError: Connection reset by peer"), 1: (1, "raised ValueError: boom")}
    p._first_report = time.monotonic() - (DEAD_AFTER_S + HEARTBEAT_S + 0.1)
    assert p._verdict({1: 9.0, 2: 0.1, 3: 9.0}) == "rank 1 (h1 pid 101) raised ValueError: boom"


class _Work:
    """A c10d work stand-in: done after ``slices`` timed waits, or failed with ``error``."""

    def __init__(self, slices: int | None = None, error: str | None = None):
        self.slices, self.error, self.waits = slices, error, 0

    def is_completed(self) -> bool:
        return self.error is not None or (self.slices is not None and self.waits > self.slices)

    def wait(self, timeout):
        self.waits += 1
        if self.error is not None:
            raise RuntimeError(self.error)
        if self.slices is None or self.waits <= self.slices:
            time.sleep(min(timeout.total_seconds(), 0.02))
            raise RuntimeError("Operation timed out!")
        return True


def test_a_collective_that_never_ends_raises_the_failure_once_aborted():
    """gloo's ring all-reduce can wait in a send to a killed peer until the group's timeout: the
    wait raises the watch's failure as soon as abort_collectives is called."""
    import threading

    from fxcompiler.ops.collectives import abort_collectives, clear_collectives_abort, wait_work

    failure = RuntimeError("rank 1 stopped its heartbeat")
    timer = threading.Timer(0.3, abort_collectives, args=(failure,))
    t0 = time.monotonic()
    timer.start()
    try:
        with pytest.raises(RuntimeError) as err:
            wait_work(_Work())
        assert err.value is failure and time.monotonic() - t0 < 0.3 + 2 * 0.25 + 0.5
        with pytest.raises(RuntimeError) as err:  # and every later collective, before it starts
            wait_work(_Work(slices=0))
        assert err.value is failure
    finally:
        timer.cancel()
        clear_collectives_abort()
    wait_work(_Work(slices=0))


def test_wait_work_waits_out_slow_collectives_and_raises_their_own_errors():
    from fxcompiler.ops.collectives import wait_work

    slow = _Work(slices=3)
    wait_work(slow)
    assert slow.waits == 4
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        wait_work(_Work(error="Connection closed by peer"))
    timed_out = _Work(error="Timed out waiting 300000ms for send operation to complete")
    with pytest.raises(RuntimeError, match="Timed out waiting"):  # gloo's own timeout is not a slice
        wait_work(timed_out)
    assert timed_out.waits == 1


def test_cpu_collective_references_on_a_gloo_group_and_after_an_abort(tmp_path):
    """A world of one gloo rank: the references return new tensors (the input untouched), and
    raise the abort's error without starting a collective."""
    import torch
    import torch.distributed as dist

    from fxcompiler.ops.collectives import (abort_collectives, all_gather_reference, all_reduce_reference,
                                            clear_collectives_abort)

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        name = dist.group.WORLD.group_name
        x = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
        y = all_reduce_reference(x, name)
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr() and y.is_contiguous()
        assert torch.equal(all_gather_reference(x, 1, name), x)
        failure = RuntimeError("rank 1 died")
        abort_collectives(failure)
        for call in (lambda: all_reduce_reference(x, name), lambda: all_gather_reference(x, 1, name)):
            with pytest.raises(RuntimeError) as err:
                call()
            assert err.value is failure
        clear_collectives_abort()
        assert torch.equal(all_reduce_reference(x, name), x)
    finally:
        clear_collectives_abort()
        dist.destroy_process_group()
