"""The ``fxc::linear`` autotuner (backends/cpu/autotune.py) and the IR/backend split of the linear ops."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import backends.cpu as fxc
from backends.cpu import autotune
from backends.cpu.autotune import LinearAutotuner
from fxcompiler.ops import linear as linear_ops

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FXCOMPILER_CACHE_DIR", str(tmp_path))
    return tmp_path


def _fast(**kw):
    return LinearAutotuner(seconds_per_shape=0.02, max_stalled=1.0, **kw)


def test_measure_then_read_from_cache(cache, monkeypatch):
    t1 = _fast()
    if t1.isa() == "aten":
        pytest.skip("no kernels on this machine")
    r1 = t1.measure(64, 96, torch.float32, "matmul", (1, 4))
    assert not r1.cached and t1.measured == 1
    assert set(r1.fxc) == set(r1.aten) == {1, 4} and all(v > 0 for v in [*r1.fxc.values(), *r1.aten.values()])
    path = t1.cache_file()
    assert path.parent == cache / "autotune" and path.exists()
    assert fxc.isa().split("+")[0] in path.name and Path(autotune._build.state()["path"]).stem in path.name
    key = r1.info["key"]
    assert key in json.loads(path.read_text())

    t2 = LinearAutotuner()
    monkeypatch.setattr(t2, "_measure", lambda *a: pytest.fail("re-measured a cached shape"))
    r2 = t2.measure(64, 96, torch.float32, "matmul", (1, 4))
    assert r2.cached and r2.fxc == r1.fxc and r2.aten == r1.aten and t2.measured == 0

    # another dtype, baseline or M set is another entry; both stay in the file
    t3 = _fast()
    r3 = t3.measure(64, 96, torch.bfloat16, "linear", (1,))
    assert not r3.cached and t3.measured == 1
    assert {key, r3.info["key"]} <= set(json.loads(path.read_text()))


def test_corrupt_cache_is_remeasured(cache):
    t = _fast()
    if t.isa() == "aten":
        pytest.skip("no kernels on this machine")
    path = t.cache_file()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert not _fast().measure(32, 32, torch.float32, "matmul", (1,)).cached
    assert _fast().measure(32, 32, torch.float32, "matmul", (1,)).cached


def test_stalled_timings_are_not_cached(cache, monkeypatch):
    t = LinearAutotuner(seconds_per_shape=0.02)
    if t.isa() == "aten":
        pytest.skip("no kernels on this machine")
    monkeypatch.setattr(autotune, "_bench", lambda fns, budget, preps=None: ([1e-5, 2e-5], 0.9))
    r = t.measure(64, 64, torch.float32, "matmul", (1,))
    assert r.info.get("unreliable") and not t.cache_file().exists()
    monkeypatch.setattr(autotune, "_bench",
                        lambda fns, budget, preps=None: pytest.fail("re-timed a shape this build measured"))
    again = t.measure(64, 64, torch.float32, "matmul", (1,))  # the next node of that shape
    assert again.info.get("unreliable") and (again.fxc, again.aten) == (r.fxc, r.aten) and t.measured == 1
    assert not LinearAutotuner()._load()  # nothing on disk


def _sleeper(seconds, calls):
    import time

    def f(i):
        calls.append(i)
        time.sleep(seconds)
    return f


def test_a_clear_loss_is_decided_without_rounds():
    """A candidate > 10x slower on two calls is not timed 20 more times (ATen's bf16 matmul without
    AVX-512-BF16 takes ~1 s a call at M = 256); close candidates still get interleaved rounds."""
    fast, slow = [], []
    times, stalled = autotune._bench([_sleeper(0.0002, fast), _sleeper(0.3, slow)], budget_s=0.05)
    assert len(slow) == len(fast) == 2 and stalled == 0.0  # a cold and a warm call each
    assert times[1] > autotune.CLEAR_LOSS_RATIO * times[0]
    a, b = [], []
    times, _ = autotune._bench([_sleeper(0.001, a), _sleeper(0.004, b)], budget_s=0.05)
    assert len(a) >= 4 + 5 and len(b) == len(a) and times[0] < times[1]  # warm-up and estimate, then rounds


def test_aten_is_not_run_at_larger_m_once_it_lost_by_far(cache, monkeypatch):
    t = LinearAutotuner(seconds_per_shape=0.02)
    if t.isa() == "aten":
        pytest.skip("no kernels on this machine")
    calls, real = [], torch.matmul

    def slow_matmul(*a, **kw):
        import time

        calls.append(a[0].shape[0])
        # 0.3 s: ATen must lose by CLEAR_LOSS_RATIO even when the kernel's call right after this sleep waits
        # milliseconds for the other vCPU to wake (4-7 ms seen on a shared VM); under NO_STALL_LASTS_S
        time.sleep(0.3)
        return real(*a, **kw)

    monkeypatch.setattr(torch, "matmul", slow_matmul)
    r = t.measure(64, 64, torch.float32, "matmul", (1, 4, 16))
    assert calls == [1, 1]  # M = 1: a cold and a warm call; M = 4 and 16 are not run
    assert r.aten[4] == r.aten[16] == r.aten[1] > autotune.CLEAR_LOSS_RATIO * max(r.fxc.values())


def test_a_compute_bound_timing_is_not_a_stall(cache, monkeypatch):
    """M = 256 streams the weight once in ~ms: under 1 GB/s, yet tens of GFLOP/s, a real timing (it is
    cached), while the same time at M = 1 is a stall."""
    t = LinearAutotuner(seconds_per_shape=0.02)
    if t.isa() == "aten":
        pytest.skip("no kernels on this machine")
    monkeypatch.setattr(autotune, "_bench", lambda fns, budget, preps=None: ([8e-3, 2e-2], 0.0))
    r = t.measure(576, 3072, torch.bfloat16, "matmul", (256,))  # 3.5 MB of weight in 8 ms: 0.44 GB/s, 113 GFLOP/s
    assert not r.info.get("unreliable") and r.info["key"] in json.loads(t.cache_file().read_text())
    r = t.measure(576, 3072, torch.bfloat16, "matmul", (1,))  # 3.5 MB in 8 ms at M = 1: a stall
    assert r.info.get("unreliable")


def test_each_timed_call_finds_its_weight_flushed(cache, monkeypatch):
    """Every timed call of either candidate is preceded by a flush of the weight it reads (a step of a model larger
    than the last-level cache reads every weight from DRAM), and only one copy of each weight is made; the flush
    leaves the bytes as they were."""
    from backends.cpu import _build

    t = _fast()
    if t.isa() == "aten":
        pytest.skip("no kernels on this machine")
    w = torch.randn(64, 32)
    before = w.clone()
    assert _build.evict(w) and torch.equal(w, before)
    flushed, real_bench = [], autotune._bench

    def spy_bench(fns, budget, preps=None):
        assert preps is not None and len(preps) == len(fns) == 2
        calls = []

        def wrap(f, j):
            def g(i):
                calls.append((j, "call"))
                return f(i)
            return g

        def wrap_prep(p, j):
            def g(i):
                calls.append((j, "flush"))
                return p(i)
            return g
        out = real_bench([wrap(f, j) for j, f in enumerate(fns)], budget, [wrap_prep(p, j) for j, p in enumerate(preps)])
        for j in (0, 1):  # each candidate's calls alternate with flushes of its weight, a flush first
            mine = [kind for c, kind in calls if c == j]
            assert mine[0::2] == ["flush"] * len(mine[0::2]) and mine[1::2] == ["call"] * len(mine[1::2])
        flushed.append(len(calls))
        return out

    monkeypatch.setattr(autotune, "_bench", spy_bench)
    r = t.measure(48, 64, torch.float32, "matmul", (1, 4))
    assert len(flushed) == 2 and all(n >= 8 for n in flushed) and "_cold" in r.info["key"]


def test_backend_reexports_the_ir_level_ops():
    assert fxc.pack_linear_weight is linear_ops.pack_linear_weight
    assert fxc.linear_aten is linear_ops.linear_reference and fxc.linear_w8_aten is linear_ops.linear_w8_reference
    assert isinstance(LinearAutotuner(), linear_ops.LinearKernelTuner)


def test_ir_level_ops_run_without_the_backend():
    """fxcompiler.ops alone defines fxc::linear with its ATen reference (no backend import, no build)."""
    code = textwrap.dedent("""
        import sys, torch, torch.nn.functional as F
        import fxcompiler.ops
        from fxcompiler.ops.linear import pack_linear_weight
        w, x, b = torch.randn(40, 24), torch.randn(3, 24), torch.randn(40)
        for dt in (torch.float32, torch.bfloat16):
            y = torch.ops.fxc.linear(x, pack_linear_weight(w, dt), b, 40)
            torch.testing.assert_close(y, F.linear(x, w.to(dt).float(), b), rtol=1e-5, atol=1e-5)
        assert not [m for m in sys.modules if m == "backends" or m.startswith("backends.")]
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]
