"""``lower_cpu_kernels``: parameter matmuls -> ``fxc::linear`` on prepacked weights.

Semantics (hypothesis over tiny configs x buckets, fp32 and bf16 weights), node counts and
parameter signature when forced, the tuner's decisions, the autotuning cache seen from the
pass, and the fallbacks (no tuner, kernels unavailable)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import backends.cpu as fxc_cpu
from fxcompiler import testing
from fxcompiler.ops.linear import LinearKernelTuner, LinearTimings, unpack_linear_weight
from fxcompiler.pass_manager import DEFAULT_PASSES, get_pass

ROOT = Path(__file__).resolve().parents[2]
aten = torch.ops.aten
FXC_LINEAR = torch.ops.fxc.linear.default
BEFORE = DEFAULT_PASSES[:DEFAULT_PASSES.index("fuse_projections") + 1]
CFG = testing.TinyConfig("llama", layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, intermediate=48)


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    fxc_cpu.kernels_available()  # build/load once, outside the hypothesis examples


def _before():
    return tuple(get_pass(n) for n in BEFORE)


def _run(program, *passes):
    ctx = testing.context_of(program)
    gm = program.graph_module
    results = []
    for p in passes:
        r = p(gm, ctx)
        gm = r.graph_module
        gm.recompile()
        results.append(r)
    return gm, ctx, results


def _param_matmuls(gm, ctx) -> int:
    """matmul/mm/addmm/linear nodes whose weight operand is a parameter."""
    count = 0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in (aten.matmul.default, aten.mm.default, aten.linear.default):
            count += ctx.param_of(n.args[1]) is not None
        elif n.target is aten.addmm.default:
            count += ctx.param_of(n.args[2]) is not None
    return count


class FakeTuner:
    """Canned timings: ``speedup(k, n, dtype, m)`` = t_aten / t_fxc."""

    def __init__(self, speedup=lambda k, n, dtype, m: 2.0, isa="avx512"):
        self.speedup, self._isa, self.calls = speedup, isa, []

    def isa(self):
        return self._isa

    def measure(self, k, n, weight_dtype, baseline, ms):
        self.calls.append((k, n, weight_dtype, baseline, tuple(ms)))
        return LinearTimings({m: 1e-5 for m in ms}, {m: 1e-5 * self.speedup(k, n, weight_dtype, m) for m in ms})


# -- semantics -----------------------------------------------------------------------------------
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=testing.model_configs(), bucket=testing.buckets())
def test_lowering_preserves_semantics_fp32(cfg, bucket):
    program = testing.capture_tiny_model(cfg, dtype=torch.float32)
    info = testing.assert_pass_preserves_semantics(get_pass("lower_cpu_kernels", force=True), program,
                                                   testing.example_inputs(program, bucket), rtol=1e-4, atol=1e-5,
                                                   passes_before=_before())
    assert info["lowered"] > 0 and info["kept"] == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=testing.model_configs(), bucket=testing.buckets())
def test_lowering_preserves_semantics_bf16(cfg, bucket):
    program = testing.capture_tiny_model(cfg, dtype=torch.bfloat16)
    info = testing.assert_pass_preserves_semantics(get_pass("lower_cpu_kernels", force=True), program,
                                                   testing.example_inputs(program, bucket), rtol=2e-2, atol=2e-2,
                                                   passes_before=_before())
    assert info["lowered"] > 0


def test_lowering_after_auto_bfloat16_cast():
    """An fp32 checkpoint cast by ``auto_bfloat16_cast`` (before ``weight_layout``): bf16 weights get bf16 kernels."""
    names = list(BEFORE)
    names.insert(names.index("weight_layout"), "auto_bfloat16_cast")
    before = tuple(get_pass(n, enabled=True) if n == "auto_bfloat16_cast" else get_pass(n) for n in names)
    for arch in ("llama", "gpt2"):
        cfg = testing.TinyConfig(arch, layers=2, hidden=32, heads=4, kv_heads=4 if arch == "gpt2" else 2, vocab=64,
                                 intermediate=48)
        program = testing.capture_tiny_model(cfg, dtype=torch.float32)
        info = testing.assert_pass_preserves_semantics(
            get_pass("lower_cpu_kernels", force=True), program, testing.example_inputs(program, testing.TestBucket(2, 3, 5, 4)),
            rtol=2e-2, atol=2e-2, passes_before=before)
        assert info["lowered"] == 2 * 4 + 1 and {d["dtype"] for d in info["decisions"]} == {"bfloat16"}


def test_lowering_without_weight_layout_and_with_tied_embedding():
    """aten.linear (weight_layout off) and GPT-2's addmm on [K, N] Conv1D weights are lowered too."""
    for cfg in (CFG, testing.TinyConfig("gpt2", layers=2, hidden=32, heads=4, kv_heads=4, vocab=97,
                                        intermediate=48)):
        program = testing.capture_tiny_model(cfg, dtype=torch.float32)
        inputs = testing.example_inputs(program, testing.TestBucket(2, 3, 5, 4))
        info = testing.assert_pass_preserves_semantics(get_pass("lower_cpu_kernels", force=True), program, inputs,
                                                       rtol=1e-4, atol=1e-5)
        assert info["lowered"] == 2 * (4 if cfg.arch == "gpt2" else 7) + 1


# -- graph and signature ---------------------------------------------------------------------------
def test_forced_lowering_replaces_every_parameter_matmul():
    program = testing.capture_tiny_model(CFG, dtype=torch.float32)
    gm, ctx, _ = _run(program, *_before())
    n_before = _param_matmuls(gm, ctx)
    weights_kn = {ctx.placeholder_spec(n.args[1]).target: ctx.param_of(n.args[1]).clone()
                  for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.matmul.default
                  and ctx.param_of(n.args[1]) is not None}
    r = get_pass("lower_cpu_kernels", force=True)(gm, ctx)
    gm = r.graph_module
    gm.recompile()
    ops = Counter(n.target for n in gm.graph.nodes if n.op == "call_function")
    # per layer: fused qkv, o, fused gate/up, down; plus lm_head
    assert n_before == 4 * CFG.layers + 1
    assert ops[FXC_LINEAR] == n_before == r.info["lowered"] and _param_matmuls(gm, ctx) == 0
    assert r.info["packed_params"] == n_before
    # the [K, N] weights are gone, replaced by their packed form (same values)
    for target, w in weights_kn.items():
        assert target not in ctx.params
        packed = ctx.params[target + ".packed"]
        assert packed.shape == (-(-w.shape[1] // 32), w.shape[0], 32)
        assert torch.equal(unpack_linear_weight(packed, w.shape[1], w.shape[0]), w.t())
    assert not [s for s in ctx.input_specs if s.kind == "param" and s.target.endswith(".T")]
    gm.graph.lint()


def test_tied_embedding_keeps_its_table():
    cfg = testing.TinyConfig("gpt2", layers=1, hidden=32, heads=4, kv_heads=4, vocab=64, intermediate=48)
    program = testing.capture_tiny_model(cfg, dtype=torch.float32)
    gm, ctx, _ = _run(program, *_before(), get_pass("lower_cpu_kernels", force=True))
    targets = {s.target for s in ctx.input_specs if s.kind == "param"}
    # export lifts the tied table once (as lm_head's): the embedding lookup still reads it as [V, K]
    embedding = next(n for n in gm.graph.nodes if n.target is aten.embedding.default)
    table = ctx.placeholder_spec(embedding.args[0]).target
    assert ctx.params[table].shape == (64, 32)
    assert table + ".T" not in targets and table + ".T.packed" in targets


def test_bias_add_is_folded():
    """matmul + add(bias) (weight_layout's form of a biased linear) becomes one fxc::linear with the bias."""
    program = testing.capture_tiny_model(testing.TinyConfig("qwen2", layers=1, hidden=32, heads=4, kv_heads=2,
                                                            vocab=64, intermediate=48), dtype=torch.float32)
    gm, _ctx, (*_, r) = _run(program, get_pass("weight_layout"), get_pass("lower_cpu_kernels", force=True))
    with_bias = [n for n in gm.graph.nodes if n.target is FXC_LINEAR and n.args[2] is not None]
    assert len(with_bias) == 3  # q, k, v projections of Qwen2
    assert r.info["lowered"] == 7 + 1
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        program = testing.capture_tiny_model(testing.TinyConfig("qwen2", layers=2, hidden=32, heads=4, kv_heads=2,
                                                                vocab=64, intermediate=48), dtype=dtype)
        testing.assert_pass_preserves_semantics(get_pass("lower_cpu_kernels", force=True), program,
                                                testing.example_inputs(program, testing.TestBucket(2, 5, 3, 4)),
                                                rtol=tol, atol=tol, passes_before=(get_pass("weight_layout"),))


# -- decisions -------------------------------------------------------------------------------------
def test_tuner_decides_per_shape_and_records_it():
    cfg = testing.TinyConfig("llama", layers=2, hidden=32, heads=4, kv_heads=2, vocab=97, intermediate=48)
    program = testing.capture_tiny_model(cfg, dtype=torch.float32)
    # fxc wins everywhere except on the lm_head shape (K = 32, N = vocab = 97)
    tuner = FakeTuner(lambda k, n, dt, m: 0.5 if (k, n) == (32, 97) else 1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, _, (*_, r) = _run(program, *_before(), get_pass("lower_cpu_kernels", tuner=tuner))
    shapes = {(d["k"], d["n"]): d for d in r.info["decisions"]}
    assert len(tuner.calls) == len(shapes)  # one measurement per distinct shape
    assert {c[4] for c in tuner.calls} == {(1, 16, 64, 256)} and {c[3] for c in tuner.calls} == {"matmul"}
    assert len(shapes) == 5  # qkv, o, gate/up, down, lm_head
    assert shapes[(32, 97)]["use_fxc"] is False and shapes[(32, 97)]["speedup"] == 0.5
    assert all(d["use_fxc"] for s, d in shapes.items() if s != (32, 97))
    assert r.info["lowered"] == 4 * CFG.layers and r.info["kept"] == 1 and r.info["isa"] == "avx512"


@pytest.mark.parametrize("m1, m64, decode_weight, lowered", [
    (1.5, 0.8, None, True), (0.9, 1.3, None, True), (0.93, 1.15, None, True), (0.8, 1.1, None, False),
    (1.02, 1.0, None, True), (0.9, 1.3, 0.75, False), (1.5, 0.8, 0.25, False)])
def test_decision_weighs_batch1_and_batched_speedups(m1, m64, decode_weight, lowered):
    """The uniform choice (one for every M, ``per_m_range=False``): geometric mean of the speedups at M = 1 and
    at the batched Ms (16, 64, 256, all ``m64`` here), equal weights unless decode_weight says otherwise. The
    per-M-range plan built on it: tests/passes/test_lower_cpu_kernels_ranges.py."""
    program = testing.capture_tiny_model(CFG, dtype=torch.float32)
    tuner = FakeTuner(lambda k, n, dt, m: m1 if m == 1 else m64)
    options = {"tuner": tuner, "per_m_range": False}
    if decode_weight is not None:
        options["decode_weight"] = decode_weight
    _, _, (*_, r) = _run(program, *_before(), get_pass("lower_cpu_kernels", **options))
    assert (r.info["lowered"] > 0) is lowered


def test_tuner_from_context_options():
    program = testing.capture_tiny_model(CFG, dtype=torch.float32)
    gm, ctx, _ = _run(program, *_before())
    tuner = FakeTuner()
    assert isinstance(tuner, LinearKernelTuner)
    ctx.options["kernel_tuner"] = tuner
    r = get_pass("lower_cpu_kernels")(gm, ctx)
    assert r.info["lowered"] == 4 * CFG.layers + 1 and tuner.calls


def test_real_tuner_second_build_reads_the_cache(tmp_path, monkeypatch):
    from backends.cpu.autotune import LinearAutotuner

    monkeypatch.setenv("FXCOMPILER_CACHE_DIR", str(tmp_path))
    program = testing.capture_tiny_model(CFG, dtype=torch.float32)
    first = LinearAutotuner(seconds_per_shape=0.02, max_stalled=1.0)
    _, _, (*_, r1) = _run(program, *_before(), get_pass("lower_cpu_kernels", tuner=first))
    assert first.measured == len(r1.info["decisions"]) > 0
    assert not any(d["cached"] for d in r1.info["decisions"])
    assert all(d["fxc_us"][1] > 0 and d["aten_us"][64] > 0 for d in r1.info["decisions"])
    second = LinearAutotuner()
    monkeypatch.setattr(second, "_measure", lambda *a: pytest.fail("re-measured a cached shape"))
    program = testing.capture_tiny_model(CFG, dtype=torch.float32)
    _, _, (*_, r2) = _run(program, *_before(), get_pass("lower_cpu_kernels", tuner=second))
    assert second.measured == 0 and all(d["cached"] for d in r2.info["decisions"])
    assert [d["use_fxc"] for d in r2.info["decisions"]] == [d["use_fxc"] for d in r1.info["decisions"]]
    assert r2.info["lowered"] == r1.info["lowered"]


# -- fallbacks ---------------------------------------------------------------------------------------
def _one_warning(fn):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fn()
    msgs = [str(w.message) for w in rec if "lower_cpu_kernels" in str(w.message)]
    assert len(msgs) == 1, msgs
    return out, msgs[0]


def test_no_tuner_and_not_forced_keeps_aten_with_one_warning():
    program = testing.capture_tiny_model(CFG, dtype=torch.float32)
    gm, ctx, _ = _run(program, *_before())
    n = _param_matmuls(gm, ctx)
    r, msg = _one_warning(lambda: get_pass("lower_cpu_kernels")(gm, ctx))
    assert not r.modified and r.info["lowered"] == 0 and _param_matmuls(gm, ctx) == n and "tuner" in msg


def test_unavailable_kernels_keep_aten_with_one_warning():
    program = testing.capture_tiny_model(CFG, dtype=torch.float32)
    gm, ctx, _ = _run(program, *_before())
    tuner = FakeTuner(isa="aten")
    for force in (False, True):
        r, msg = _one_warning(lambda force=force: get_pass("lower_cpu_kernels", tuner=tuner, force=force)(gm, ctx))
        assert not r.modified and r.info["lowered"] == 0 and "unavailable" in msg
    assert not tuner.calls and not any(n.target is FXC_LINEAR for n in gm.graph.nodes)


def test_fp64_weights_are_left_alone():
    program = testing.capture_tiny_model(CFG)  # float64
    _, _, (*_, r) = _run(program, *_before(), get_pass("lower_cpu_kernels", force=True))
    assert r.info["lowered"] == 0 and not r.modified


def test_isa_aten_subprocess_one_warning(tmp_path):
    """The real tuner with FXCOMPILER_CPU_ISA=aten: no lowering, one warning for the whole graph."""
    code = textwrap.dedent("""
        import warnings, torch
        from fxcompiler import testing
        from fxcompiler.pass_manager import DEFAULT_PASSES, get_pass
        from fxcompiler.build import pass_services
        cfg = testing.TinyConfig("llama", layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, intermediate=48)
        program = testing.capture_tiny_model(cfg, dtype=torch.float32)
        ctx = testing.context_of(program)
        ctx.options.update(pass_services(torch.device("cpu")))
        gm = program.graph_module
        for n in DEFAULT_PASSES[:DEFAULT_PASSES.index("fuse_projections") + 1]:
            gm = get_pass(n)(gm, ctx).graph_module
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            r = get_pass("lower_cpu_kernels")(gm, ctx)
        msgs = [str(w.message) for w in rec if "fxc" in str(w.message) or "lower_cpu" in str(w.message)]
        assert r.info["lowered"] == 0 and r.info["isa"] == "aten", r.info
        assert len(msgs) == 1, msgs
        print("OK", msgs[0])
    """)
    env = dict(os.environ, FXCOMPILER_CPU_ISA="aten", FXCOMPILER_CACHE_DIR=str(tmp_path))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr[-3000:]


def test_pass_services_cpu_only():
    from fxcompiler.build import pass_services

    assert isinstance(pass_services(torch.device("cpu"))["kernel_tuner"], LinearKernelTuner)
    assert pass_services(torch.device("meta")) == {}
