"""fxcompiler/multihost.py's pure parts: the rank layout, refused worlds, and how rank 0's watch
names the failed rank (the end-to-end torchrun runs are in tests/test_parallel.py)."""
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
