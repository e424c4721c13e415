"""``lower_cpu_kernels``'s per-M-range choice: the plan (:func:`plan_m_ranges`) as a function of the
per-M speedups, the graph it yields (``fxc::linear_by_m`` holding both layouts only where the choice
differs between Ms), and ``fxc::linear_by_m`` choosing per call from M — through the C++ kernel, its
reference, the native executor and a graph-source round trip. Timings are canned (a fake tuner): these
test the choice, not the machine."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import backends.cpu as fxc_cpu
from backends import graph_program
from fxcompiler import graph_io, testing
from fxcompiler.ops.linear import linear_by_m_reference, m_in_ranges, pack_linear_weight
from fxcompiler.pass_manager import get_pass
from passes.lower_cpu_kernels import MRange, fxc_ranges, plan_m_ranges

from .test_lower_cpu_kernels import CFG, FakeTuner, _before, _run

BY_M = torch.ops.fxc.linear_by_m.default
FXC_LINEAR = torch.ops.fxc.linear.default


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    fxc_cpu.kernels_available()


def _range_of(plan: list[MRange], m: int) -> MRange:
    return next(r for r in plan if m >= r.lo and (r.hi is None or m <= r.hi))


# -- the plan --------------------------------------------------------------------------------------
speedup_maps = st.dictionaries(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256, 512]),
                               st.floats(0.2, 5.0, allow_nan=False), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(speedup_maps, st.booleans(), st.sampled_from([1.0, 1.05, 1.1, 1.5]), st.sampled_from([0.9, 1.0, 1.2]))
def test_plan_properties(speedups, uniform, margin, min_speedup):
    plan = plan_m_ranges(speedups, uniform, min_speedup, margin)
    # ranges tile 0 ... unbounded in order, and neighbours differ (merged)
    assert plan[0].lo == 0 and plan[-1].hi is None
    for a, b in zip(plan, plan[1:]):
        assert a.hi is not None and b.lo == a.hi + 1 and a.use_fxc != b.use_fxc
    ms = sorted(speedups)
    for m in ms:
        s = speedups[m]
        want = s > min_speedup * margin if not uniform else not s < min_speedup / margin
        assert _range_of(plan, m).use_fxc is want  # each measured M gets its own rule's choice
    # a measured M stands for the rows up to the integer geometric midpoint with the next one
    for lo_m, hi_m in zip(ms, ms[1:]):
        split = max(lo_m, math.isqrt(lo_m * hi_m))
        for m in range(lo_m, hi_m + 1):
            assert _range_of(plan, m).use_fxc is _range_of(plan, lo_m if m <= split else hi_m).use_fxc
    assert all(_range_of(plan, m).use_fxc is _range_of(plan, ms[0]).use_fxc for m in range(ms[0]))
    assert _range_of(plan, 10**9).use_fxc is _range_of(plan, ms[-1]).use_fxc
    # fxc_m, as fxc::linear_by_m reads it, picks fxc exactly where the plan does
    enc = fxc_ranges(plan)
    for m in sorted({0, 1, 3, 5, 33, 100, 129, 1000, 10**6} | set(ms)):
        assert m_in_ranges(m, enc) is _range_of(plan, m).use_fxc


def test_plan_examples():
    # bf16 on a CPU without AMX before the VDPBF16PS kernel: fxc wins the GEMV, ATen the GEMM
    plan = plan_m_ranges({1: 1.6, 16: 1.2, 64: 0.7, 256: 0.6}, uniform=True)
    assert plan == [MRange(0, 32, True), MRange(33, None, False)]
    assert fxc_ranges(plan) == [0, 32]
    # within the margin the uniform choice stays: one range, no second layout
    assert plan_m_ranges({1: 1.05, 64: 0.95}, uniform=True) == [MRange(0, None, True)]
    assert plan_m_ranges({1: 0.95, 64: 1.05}, uniform=False) == [MRange(0, None, False)]
    # a win in the middle only
    plan = plan_m_ranges({1: 0.5, 16: 1.5, 64: 0.5}, uniform=False)
    assert plan == [MRange(0, 4, False), MRange(5, 32, True), MRange(33, None, False)]
    assert fxc_ranges(plan) == [5, 32]
    assert fxc_ranges([MRange(0, 8, False), MRange(9, None, True)]) == [9, -1]
    with pytest.raises(ValueError, match="range_margin"):
        plan_m_ranges({1: 1.0}, True, range_margin=0.5)


# -- the pass ----------------------------------------------------------------------------------------
def _mixed(k, n, dt, m):
    return 1.6 if m <= 16 else 0.6  # fxc wins M <= 16, ATen above: M 0 ... 32 fxc


def test_pass_lowers_mixed_shapes_to_linear_by_m_and_keeps_both_layouts():
    program = testing.capture_tiny_model(CFG, dtype=torch.float32)
    tuner = FakeTuner(_mixed)
    gm, ctx, (*_, r) = _run(program, *_before(), get_pass("lower_cpu_kernels", tuner=tuner, max_dual_fraction=1.0))
    assert {c[4] for c in tuner.calls} == {(1, 16, 64, 256)}
    assert all(d["ranged"] and d["plan"] == [(0, 32, "fxc"), (33, None, "aten")] and d["fxc_m"] == [0, 32]
               for d in r.info["decisions"])
    nodes = [n for n in gm.graph.nodes if n.target is BY_M]
    assert len(nodes) == r.info["lowered"] == r.info["ranged"] == 4 * CFG.layers + 1
    assert not any(n.target is FXC_LINEAR for n in gm.graph.nodes)
    for n in nodes:  # both layouts bound: the packed weight and the parameter ATen reads
        w_dense = ctx.param_of(n.args[2])
        assert ctx.param_of(n.args[1]) is not None and w_dense is not None and n.args[6] == [0, 32]
        assert tuple(w_dense.shape) == ((n.args[0].meta["val"].shape[-1], n.args[5]) if n.args[3]
                                        else (n.args[5], n.args[0].meta["val"].shape[-1]))
    assert r.info["dual_layout_bytes"] == sum(
        {ctx.placeholder_spec(n.args[2]).target: ctx.param_of(n.args[2]).numel() * 4 for n in nodes}.values())


@pytest.mark.parametrize("speedup, by_m, plain, kept", [
    (lambda k, n, dt, m: 1.6, 0, 4 * 2 + 1, 0),                    # fxc at every M: plain fxc::linear
    (lambda k, n, dt, m: 0.6, 0, 0, 4 * 2 + 1),                    # ATen at every M: untouched
    (lambda k, n, dt, m: 1.05 if m == 1 else 0.97, 0, 4 * 2 + 1, 0),  # differences within the margin
    (lambda k, n, dt, m: 0.6 if (k, n) == (48, 32) else _mixed(k, n, dt, m), 4 * 2 - 1, 0, 2),  # down_proj ATen
])
def test_pass_one_choice_per_m_stays_one_op(speedup, by_m, plain, kept):
    program = testing.capture_tiny_model(CFG, dtype=torch.float32)
    gm, _, (*_, r) = _run(program, *_before(),
                          get_pass("lower_cpu_kernels", tuner=FakeTuner(speedup), max_dual_fraction=1.0))
    counts = [sum(n.target is t for n in gm.graph.nodes) for t in (BY_M, FXC_LINEAR)]
    assert counts == [by_m, plain] and r.info["kept"] == kept and r.info["ranged"] == by_m
    assert (r.info["dual_layout_bytes"] > 0) is (by_m > 0)


def test_per_m_range_off_is_one_choice_for_every_m():
    program = testing.capture_tiny_model(CFG, dtype=torch.float32)
    gm, _, (*_, r) = _run(program, *_before(),
                          get_pass("lower_cpu_kernels", tuner=FakeTuner(_mixed), per_m_range=False))
    # weighted geometric mean: 0.5 ln 1.6 + (1/6)(ln 1.6 + 2 ln 0.6) > 0 -> fxc::linear for every M
    assert not any(n.target is BY_M for n in gm.graph.nodes)
    assert sum(n.target is FXC_LINEAR for n in gm.graph.nodes) == r.info["lowered"] == 4 * CFG.layers + 1
    assert all(not d["ranged"] and d["use_fxc"] for d in r.info["decisions"]) and r.info["dual_layout_bytes"] == 0


def test_second_layouts_stay_within_the_budget_largest_gain_first():
    """Every shape mixed, the gate/up shape (K 32 -> N 96) with the largest gain: a budget that holds only
    its weights ranges it alone; the others keep their uniform choice; a zero budget ranges nothing."""
    program = testing.capture_tiny_model(CFG, dtype=torch.float32)

    def speedup(k, n, dt, m):
        big = (k, n) == (32, 96)
        return (3.0 if big else 1.6) if m <= 16 else (0.3 if big else 0.6)

    gm, ctx, (*_, r) = _run(program, *_before())
    weights = {n.args[1] for n in gm.graph.nodes
               if n.target is torch.ops.aten.matmul.default and ctx.param_of(n.args[1]) is not None}
    total = sum(ctx.param_of(w).numel() * 4 for w in weights)
    gate_up = 2 * 32 * 96 * 4
    for fraction, ranged_shapes in ((gate_up / total + 1e-9, {(32, 96)}), (0.0, set())):
        program = testing.capture_tiny_model(CFG, dtype=torch.float32)
        gm, _, (*_, r) = _run(program, *_before(), get_pass("lower_cpu_kernels", tuner=FakeTuner(speedup),
                                                            max_dual_fraction=fraction))
        by_shape = {(d["k"], d["n"]): d for d in r.info["decisions"]}
        assert {s for s, d in by_shape.items() if d["ranged"]} == ranged_shapes
        assert r.info["dual_layout_bytes"] == (gate_up if ranged_shapes else 0) <= fraction * total
        for s, d in by_shape.items():
            if s not in ranged_shapes:  # uniform: 0.5 ln 1.6 + (1/6)(ln 1.6 + 2 ln 0.6) > 0 -> fxc everywhere
                assert d["use_fxc"] and d["dual_budget"] == "exceeded" and d["plan"] == [(0, None, "fxc")]
        assert sum(n.target is BY_M for n in gm.graph.nodes) == (CFG.layers if ranged_shapes else 0)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_ranged_lowering_preserves_semantics_on_both_sides_of_the_split(dtype, tol):
    program = testing.capture_tiny_model(CFG, dtype=dtype)
    p = get_pass("lower_cpu_kernels", tuner=FakeTuner(lambda k, n, dt, m: 1.6 if m == 1 else 0.6),  # fxc M <= 4
                 max_dual_fraction=1.0)
    for bucket in (testing.TestBucket(1, 3, 4, 4), testing.TestBucket(2, 5, 3, 4)):  # M = 3 (fxc), 10 (ATen)
        info = testing.assert_pass_preserves_semantics(p, program, testing.example_inputs(program, bucket),
                                                       rtol=tol, atol=tol, passes_before=_before())
        assert info["ranged"] == info["lowered"] > 0


# -- the op ------------------------------------------------------------------------------------------
def _problem(k, n, dtype, kn, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return w, pack_linear_weight(w), (w.t().contiguous() if kn else w), b


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 40), st.integers(1, 70), st.integers(1, 70), st.sampled_from([torch.float32, torch.bfloat16]),
       st.booleans(), st.booleans(), st.sampled_from([[0, 4], [5, -1], [2, 3, 9, 20], []]))
def test_linear_by_m_takes_the_chosen_kernel_exactly(m, k, n, dtype, kn, with_bias, fxc_m):
    """Bit-identical to fxc::linear inside the ranges and to the ATen op outside, in the C++ kernel and in
    its Python reference alike."""
    w, wp, wd, b = _problem(k, n, dtype, kn, seed=m * 7 + k)
    b = b if with_bias else None
    x = torch.randn(m, k).to(dtype)
    if m_in_ranges(m, fxc_m):
        want = FXC_LINEAR(x, wp, b, n)
    elif kn:
        want = x @ wd if b is None else x @ wd + b
    else:
        want = torch.nn.functional.linear(x, wd, b)
    for impl in (BY_M, linear_by_m_reference):
        assert torch.equal(impl(x, wp, wd, kn, b, n, fxc_m), want)
    if m % 2 == 0:  # leading dims: M counts rows of every batch dimension
        assert torch.equal(BY_M(x.reshape(2, m // 2, k), wp, wd, kn, b, n, fxc_m), want.reshape(2, m // 2, n))


def test_linear_by_m_in_the_native_executor_and_a_graph_source_round_trip():
    k, n = 24, 40
    w, wp, wd, b = _problem(k, n, torch.float32, True)
    g = torch.fx.Graph()
    ph = [g.placeholder(name) for name in ("wp", "wd", "b", "x")]  # bound parameters first, then the input
    g.output((g.call_function(BY_M, (ph[3], ph[0], ph[1], True, ph[2], n, [0, 4])),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    again = graph_io.load_graph_module(graph_io.graph_module_source(gm))
    node = next(nd for nd in again.graph.nodes if nd.target is BY_M)
    assert node.args[3] is True and node.args[5] == n and list(node.args[6]) == [0, 4]
    prog = graph_program.compile_plan([(gm, [wp, wd, b], [0], [1])], 1, 1)
    for m in (3, 9):
        xv = torch.randn(m, k)
        want = FXC_LINEAR(xv, wp, b, n) if m <= 4 else xv @ wd + b
        assert torch.equal(gm(wp, wd, b, xv)[0], want) and torch.equal(again(wp, wd, b, xv)[0], want)
        assert torch.equal(prog.run([xv])[0], want)
