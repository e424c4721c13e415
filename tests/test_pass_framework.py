"""Pass framework v2: enforced contracts, placements, info round trips, single-pass attribution,
NaN detection, reproducers and bisection (issue 22). Most tests run a PassManager over one tiny
fp32 llama capture; the LLM(...) ones use the tiny checkpoints of conftest."""
from __future__ import annotations

import json
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

def test_default_verification_names_the_single_pass():
    """wrong_shape rewires a linear that reads fuse_rms_norm's output: only wrong_shape is named."""
    passes = _upto({"passes": {"insert": [(wrong_shape, {"after": "fuse_rope"})]}}, "wrong_shape")
    with pytest.raises(PassError) as err:
        _run(passes, [VerifyInstrument("end")])
    msg = str(err.value)
    assert msg.startswith("pass 'wrong_shape' broke node 'linear") and "one of the passes" not in msg
    assert "While executing" not in msg and "tlparse" not in msg and len(msg.splitlines()) <= 2


def test_nan_is_detected_at_build_time_and_numeric_check_names_the_node():
    assert any(isinstance(i, FiniteCheckInstrument) for i in instruments_from_options({}))
    options = {"passes": {"insert": [(negate_eps, {"after": "cse"})]}}
    with pytest.raises(PassError, match=r"non-finite logits.*first non-finite node 'rsqrt.*made by pass 'negate_eps'"):
        _run(build_pass_list(options)[:8], [VerifyInstrument("end"), FiniteCheckInstrument()])
    with pytest.raises(PassError) as err:
        _run(build_pass_list(options)[:6], [NumericCheckInstrument()])
    msg = str(err.value)
    assert "pass 'negate_eps' made logits non-finite" in msg and "by nan" not in msg
    assert "first divergent node 'rsqrt" in msg and "neg" in msg


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


def test_bisect_names_the_first_divergent_pass_and_node():
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


@pytest.mark.slow
def test_compile_bisect_finds_injected_pass_and_node_on_smollm2(capsys):
    from fxcompiler.cli import main

    spec = json.dumps({"insert": [{"pass": "tests._pass_fixtures:scale_first_silu", "after": "weight_layout"}]})
    rc = main(["compile", "HuggingFaceTB/SmolLM2-135M-Instruct", "--max-seq-len-to-capture", "128", "--bisect",
               "--passes-json", spec])
    err = capsys.readouterr().err
    assert rc == 1
    assert "bisect: pass 'scale_first_silu' changed logits" in err
    assert "first divergent node 'silu_mul" in err
