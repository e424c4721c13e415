"""Pass framework v2: enforced contracts, placements, info round trips, single-pass attribution,
NaN detection, reproducers and bisection (issue 22). Most tests run a PassManager over one tiny
fp32 llama capture; the LLM(...) ones use the tiny checkpoints of conftest."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fxcompiler import testing
from fxcompiler.instruments import (
    BisectInstrument,
    DumpInstrument,
    FiniteCheckInstrument,
    NumericCheckInstrument,
    instruments_from_options,
)
from fxcompiler.pass_manager import (
    DEFAULT_PASSES,
    PassDidNotFire,
    PassError,
    PassManager,
    PassRequirements,
    PassResult,
    VerifyInstrument,
    build_pass_list,
    pass_ids,
    passes_spec_as_json,
)

from ._pass_fixtures import negate_eps, scale_first_silu, wrong_shape

ROOT = Path(__file__).resolve().parent.parent
CFG = testing.TinyConfig("llama", layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, intermediate=48)
aten = torch.ops.aten


def _program():
    program = testing.capture_tiny_model(CFG, dtype=torch.float32)
    return program, testing.context_of(program)


def _run(passes, instruments=()):
    program, ctx = _program()
    gm = PassManager(passes, list(instruments))(program.graph_module, ctx)
    return gm, ctx


def _upto(options, anchor):
    """The pass list ``options`` builds, cut after the pass with id ``anchor``."""
    passes = build_pass_list(options)
    return passes[: pass_ids(passes).index(anchor) + 1]


# -- contracts -----------------------------------------------------------------------------------

@pytest.mark.parametrize("returned, match", [
    (lambda gm: None, "returned NoneType.*must return PassResult"),
    (lambda gm: gm, "returned GraphModule"),
    (lambda gm: (gm, True), "returned tuple"),
    (lambda gm: PassResult(gm, 1), "modified is int, expected bool"),
    (lambda gm: PassResult(gm, False, {"pass": "renamed"}), r"info keys \['pass'\] are reserved"),
    (lambda gm: PassResult(gm, False, {"seconds": 1.0}), r"info keys \['seconds'\] are reserved"),
    (lambda gm: PassResult(gm, False, {"weights": torch.ones(2)}), r"info must be JSON.*\['weights'\]"),
    (lambda gm: PassResult(gm, False, {1: "x"}), "info keys must be strings"),
])
def test_contract_violations_name_the_pass(returned, match):
    def loose_pass(gm, ctx):
        return returned(gm)

    with pytest.raises(PassError, match=f"pass 'loose_pass'.*{match}"):
        _run([loose_pass])


def test_json_info_is_kept_in_history_and_summary(tmp_path):
    def reports(gm, ctx):
        return PassResult(gm, False, {"per_layer": {"layer0": [1, 2]}, "names": ("a", "b")})

    program, ctx = _program()
    PassManager([reports], [DumpInstrument(tmp_path)])(program.graph_module, ctx)
    (record,) = ctx.history
    assert record["per_layer"] == {"layer0": [1, 2]} and record["names"] == ["a", "b"] and record["pass"] == "reports"
    (summary,) = json.loads((tmp_path / "summary.json").read_text())
    assert summary["per_layer"] == {"layer0": [1, 2]} and summary["names"] == ["a", "b"]


def test_declared_requirements_are_checked():
    def needs_rope(gm, ctx):
        return PassResult(gm, False)

    needs_rope.requires = PassRequirements(after=("fuse_rope",))
    with pytest.raises(PassError, match="'needs_rope' must run after 'fuse_rope'"):
        build_pass_list({"passes": {"insert": [(needs_rope, {"before": "fuse_rope"})]}})
    build_pass_list({"passes": {"insert": [(needs_rope, {"after": "fuse_rope"})]}})

    needs_rope.requires = PassRequirements(stage="post-decompose")
    with pytest.raises(PassError, match="requires stage 'post-decompose'"):
        build_pass_list({"passes": {"insert": [(needs_rope, {"before": "decompose"})]}})
    with pytest.raises(ValueError, match="stage must be"):
        PassRequirements(stage="late")
    # the built-in passes declare the order they need
    for misplaced, match in [({"disable": ["weight_layout"], "insert": [{"pass": "weight_layout", "after": "dce#2"}]},
                              "'fuse_projections' must run after 'weight_layout'"),
                             ({"disable": ["fuse_rope"], "insert": [{"pass": "fuse_rope", "after": "fuse_qkv_attention"}]},
                              "'fuse_qkv_attention' must run after 'fuse_rope'"),
                             ({"disable": ["lower_cpu_kernels"],
                               "insert": [{"pass": "lower_cpu_kernels", "before": "fuse_projections"}]},
                              "'lower_cpu_kernels' must run after 'fuse_projections'")]:
        with pytest.raises(PassError, match=match):
            build_pass_list({"passes": misplaced})

    def no_meta(gm, ctx):  # makes a node without meta["val"], one that cannot be derived either
        node = next(n for n in gm.graph.nodes if n.target is aten.rsqrt.default)
        with gm.graph.inserting_after(node):
            gm.graph.call_function(_opaque, (node,))
            derivable = gm.graph.call_function(aten.neg.default, (node,))
        return PassResult(gm, True, {"derivable": derivable.name})

    with pytest.raises(PassError, match=r"'fuse_rms_norm' requires meta\['val'\].*1 nodes lack it.*made by "
                                        r"\['no_meta'\]"):
        _run(_upto({"passes": {"insert": [(no_meta, {"before": "fuse_rms_norm"})]}}, "fuse_rms_norm"),
             [VerifyInstrument("end")])


def _opaque(t):
    raise RuntimeError("no fake implementation")


def test_must_fire_warns_naming_what_blocked_the_match():
    def eps_as_sub(gm, ctx):  # rsqrt(mean - (-eps)): same values, a shape fuse_rms_norm does not know
        n = 0
        for node in gm.graph.nodes:
            if node.target is aten.rsqrt.default and node.args[0].target is aten.add.Tensor:
                add = node.args[0]
                add.target, add.args = aten.sub.Tensor, (add.args[0], -add.args[1])
                n += 1
        return PassResult(gm, n > 0)

    options = {"passes": {"insert": [(eps_as_sub, {"before": "fuse_rms_norm"})], "must_fire": ["fuse_rms_norm"]}}
    with pytest.warns(PassDidNotFire, match=r"'fuse_rms_norm'.*'add[_0-9]*' is aten.sub.Tensor where the pattern "
                                            r"has aten.add.Tensor"):
        _, ctx = _run(_upto(options, "fuse_rms_norm"))
    assert ctx.history[-1]["fused"] == 0 and "blocked" in ctx.history[-1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", PassDidNotFire)
        _, ctx = _run(_upto({"passes": {"must_fire": ["fuse_rms_norm"]}}, "fuse_rms_norm"))
    assert ctx.history[-1]["fused"] == 2 * CFG.layers + 1


def test_torch_subgraph_rewriter_nodes_get_meta_val_and_a_silenced_fusion_says_why():
    """Nodes made by torch's subgraph_rewriter carry no meta['val']: the fusions after it derive them
    (refresh_meta_val); the rewrite hides silu from fuse_silu_mul, which says so when marked must_fire."""
    from torch.fx import subgraph_rewriter

    def silu_as_sigmoid(gm, ctx):
        def pattern(x):
            return aten.silu.default(x)

        def replacement(x):
            return aten.mul.Tensor(x, aten.sigmoid.default(x))

        n = len(subgraph_rewriter.replace_pattern(gm, pattern, replacement))
        return PassResult(gm, n > 0, {"replaced": n})

    options = {"passes": {"insert": [(silu_as_sigmoid, {"before": "fuse_rms_norm"})], "must_fire": ["fuse_silu_mul"]}}
    with pytest.warns(PassDidNotFire, match=r"'fuse_silu_mul'.*closest candidate.*where the pattern has "
                                            r"aten.silu.default"):
        gm, ctx = _run(_upto(options, "fuse_silu_mul"), [VerifyInstrument("end")])
    assert [h["pass"] for h in ctx.history[-3:]] == ["silu_as_sigmoid", "fuse_rms_norm", "fuse_silu_mul"]
    assert ctx.history[-3]["replaced"] == CFG.layers and ctx.history[-2]["fused"] == 2 * CFG.layers + 1
    sigmoids = [n for n in gm.graph.nodes if n.target is aten.sigmoid.default]
    assert len(sigmoids) == CFG.layers and all(isinstance(n.meta.get("val"), torch.Tensor) for n in sigmoids)


# -- placement -----------------------------------------------------------------------------------

def test_placement_keys_ids_options_and_json():
    def mine(gm, ctx):
        return PassResult(gm, False)

    with pytest.raises(ValueError, match=r"unknown placement keys \['at'\]"):
        build_pass_list({"passes": {"insert": [(mine, {"at": "dce"})]}})
    with pytest.raises(ValueError, match="'after' or 'before', not both"):
        build_pass_list({"passes": {"insert": [(mine, {"after": "dce", "before": "cse"})]}})
    ids = pass_ids(build_pass_list({"passes": {"insert": [(mine, {"after": "dce#2"})]}}))
    assert ids[ids.index("mine") - 1] == "dce#2" and ids.count("mine") == 1
    ids = pass_ids(build_pass_list({"passes": {"insert": [(mine, {"before": "dce", "occurrence": -1})]}}))
    assert ids[ids.index("mine") + 1] == "dce#3"
    with pytest.raises(ValueError, match=r"'dce' occurs 3 times.*dce#1"):
        build_pass_list({"passes": {"insert": [(mine, {"after": "dce#4"})]}})
    # options on a pass inserted by name; not on an object
    passes = build_pass_list({"passes": {"insert": [{"pass": "decompose", "options": {"model_rewrite": True},
                                                     "after": "fold_casts"}]}})
    assert [p.name for p in passes].count("decompose") == 2 and "model_rewrite\": true" in passes[3].cache_key
    with pytest.raises(ValueError, match="'options' apply to passes given by name"):
        build_pass_list({"passes": {"insert": [(mine, {"after": "dce", "options": {"x": 1}})]}})
    # the whole override as JSON text, with an import path and a disabled single occurrence
    spec = json.dumps({"disable": ["dce#3"], "insert": [{"pass": "tests._pass_fixtures:negate_eps",
                                                         "after": "cse", "must_fire": True}]})
    passes = build_pass_list({"passes": spec})
    ids = pass_ids(passes)
    assert ids[ids.index("negate_eps") - 1] == "cse" and ids.count("dce#3") == 0 and len(ids) == len(DEFAULT_PASSES)
    assert passes[ids.index("negate_eps")].must_fire
    with pytest.raises(ValueError, match="cannot import pass 'tests._pass_fixtures:nope'"):
        build_pass_list({"passes": {"insert": [{"pass": "tests._pass_fixtures:nope"}]}})
    with pytest.raises(ValueError, match="not valid JSON"):
        build_pass_list({"passes": "{insert: []"})
    assert passes_spec_as_json({"insert": [(negate_eps, {"after": "cse"})]}) == {
        "insert": [{"pass": "tests._pass_fixtures:negate_eps", "after": "cse"}]}


# -- debugging -----------------------------------------------------------------------------------

def test_default_verification_names_the_single_pass(caplog, capfd):
    """wrong_shape rewires a linear that reads fuse_rms_norm's output: only wrong_shape is named, in a
    short message, and torch's fake-tensor logging (ending in its "tlparse" hint) stays out of the way."""
    caplog.set_level(logging.INFO)
    passes = _upto({"passes": {"insert": [(wrong_shape, {"after": "fuse_rope"})]}}, "wrong_shape")
    with pytest.raises(PassError) as err:
        _run(passes, [VerifyInstrument("end")])
    msg = str(err.value)
    assert msg.startswith("pass 'wrong_shape' broke node 'linear") and "one of the passes" not in msg
    assert "While executing" not in msg and "tlparse" not in msg and len(msg.splitlines()) <= 2
    logged = caplog.text + capfd.readouterr().err
    assert "tlparse" not in logged and not [r for r in caplog.records if r.name.startswith("torch")]


def test_nan_is_detected_at_build_time_and_numeric_check_names_the_node(tmp_path):
    from fxcompiler.repro import replay

    assert any(isinstance(i, FiniteCheckInstrument) for i in instruments_from_options({}))
    options = {"passes": {"insert": [(negate_eps, {"after": "cse"})]}}
    with pytest.raises(PassError, match=r"non-finite logits.*first non-finite node 'rsqrt.*made by pass 'negate_eps'"):
        _run(build_pass_list(options)[:8], [VerifyInstrument("end"), FiniteCheckInstrument()])
    with pytest.raises(PassError) as err:
        _run(build_pass_list(options)[:6], [NumericCheckInstrument(), DumpInstrument(tmp_path)])
    msg = str(err.value)
    assert "pass 'negate_eps' made logits non-finite" in msg and "by nan" not in msg
    assert "first divergent node 'rsqrt" in msg and "neg" in msg
    # a numerically wrong pass leaves a reproducer too, and replaying it fails the same way
    repro = tmp_path / "repro-06-negate_eps"
    assert f"reproducer: {repro}" in msg and (tmp_path / "06-negate_eps.after.py").is_file()
    with pytest.raises(PassError, match=r"numeric check: pass 'negate_eps' made logits non-finite.*first divergent "
                                        r"node 'rsqrt"):
        replay(repro)


def test_nan_logits_fail_a_default_build(tiny_models, tmp_path):
    """No numeric check asked for: the sign-flip pass's NaN logits still stop LLM(...), naming the pass and
    node and pointing at the dumps and at --bisect."""
    from fxcompiler import LLM

    with pytest.raises(PassError, match=r"(?s)non-finite logits.*first non-finite node 'rsqrt.*made by pass "
                                        r"'negate_eps'.*--bisect.*dumps of every pass: " + str(tmp_path)):
        LLM(str(tiny_models["llama"]), max_seq_len_to_capture=128, cache_dir=None, skip_engine=True,
            compiler_config_overrides={"dump_dir": str(tmp_path),
                                       "passes": {"insert": [(negate_eps, {"after": "cse"})]}})


def test_rejected_pass_leaves_dump_and_a_reproducer_that_replays(tmp_path):
    passes = _upto({"passes": {"insert": [(wrong_shape, {"after": "fuse_rope"})]}}, "wrong_shape")
    with pytest.raises(PassError) as err:
        _run(passes, [VerifyInstrument("each"), DumpInstrument(tmp_path)])
    stem = f"{len(passes):02d}-wrong_shape"
    assert (tmp_path / f"{stem}.after.py").is_file() and (tmp_path / f"{stem}.code.diff").is_file()
    repro = tmp_path / f"repro-{stem}"
    assert f"reproducer: {repro}" in str(err.value)
    assert {p.name for p in repro.iterdir()} >= {"graph.py", "state.pt", "pass.json", "replay.py"}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(repro / "replay.py")], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "PassError: pass 'wrong_shape' broke node 'linear" in out.stderr
    # the same reproducer with a correct pass in its place is accepted
    from fxcompiler.pass_manager import get_pass
    from fxcompiler.repro import replay

    assert replay(repro, p=get_pass("fuse_rope"))["pass"] == "fuse_rope"


def test_bisect_names_the_first_divergent_pass_and_node(monkeypatch):
    monkeypatch.setenv("FXCOMPILER_BISECT", "1")  # the env switch; compile --bisect sets {"bisect": True}
    assert [type(i) for i in instruments_from_options({}) if isinstance(i, BisectInstrument)] == [BisectInstrument]
    monkeypatch.delenv("FXCOMPILER_BISECT")
    passes = build_pass_list({"passes": {"insert": [(scale_first_silu, {"after": "weight_layout"})]}})
    bisect = BisectInstrument()
    with pytest.raises(PassError, match=r"bisect: pass 'scale_first_silu' changed logits.*first divergent node "
                                        r"'silu_mul[_a-z0-9]*'.*inputs \['mul[_a-z0-9]*'\] are new"):
        _run(passes, [bisect])
    names = [p.name for p in passes]
    assert bisect.checked == names[:names.index("scale_first_silu")]


# -- testing helpers -----------------------------------------------------------------------------

def test_passes_before_default_up_to():
    names = [p.name for p in testing.default_passes_up_to("fuse_rope")]
    assert names == list(DEFAULT_PASSES[:DEFAULT_PASSES.index("fuse_rope")])
    assert len(testing.default_passes_up_to("dce#2")) == pass_ids(build_pass_list({})).index("dce#2")
    with pytest.raises(ValueError, match="unknown pass"):
        testing.default_passes_up_to("nope")
    program = testing.capture_tiny_model(CFG, dtype=torch.float32)
    inputs = testing.example_inputs(program, testing.TestBucket(2, 3, 5, 4))
    info = testing.assert_pass_preserves_semantics(_identity, program, inputs,
                                                   passes_before="default-up-to:fuse_rope")
    assert info == {"silu_mul": 2}


def _identity(gm, ctx):
    return PassResult(gm, False, {"silu_mul": sum(n.target is torch.ops.fxc.silu_mul.default for n in gm.graph.nodes)})


# -- LLM(...) ------------------------------------------------------------------------------------

def test_info_round_trips_through_the_compile_cache(tiny_models, tmp_path):
    from fxcompiler import LLM

    def reports(gm, ctx):
        return PassResult(gm, False, {"per_layer": {"layer0": 1, "layer1": 2}, "ops": [3, 4]})

    reports.cache_key = "reports-v1"
    options = {"passes": {"insert": [(reports, {"after": "dce#2"})]}}
    kw = dict(max_seq_len_to_capture=128, cache_dir=str(tmp_path), skip_engine=True, compiler_config_overrides=options)
    first = LLM(str(tiny_models["llama"]), **kw)
    second = LLM(str(tiny_models["llama"]), **kw)
    assert (first.build_info["compile_cache"], second.build_info["compile_cache"]) == ("miss", "hit")
    a = next(h for h in first.pass_history if h["pass"] == "reports")
    b = next(h for h in second.pass_history if h["pass"] == "reports")
    assert a["per_layer"] == b["per_layer"] == {"layer0": 1, "layer1": 2} and b["ops"] == [3, 4]
    assert b["cache_hit"] and b["seconds"] == 0.0 and b["cached_seconds"] == a["seconds"] and "cache_hit" not in a
    assert b["id"] == a["id"] == "reports"
