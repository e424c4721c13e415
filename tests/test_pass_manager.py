"""The pass contract: ordering, user passes plugged into LLM(...), error reporting."""
from __future__ import annotations

import pytest
import torch

from fxcompiler import LLM, SamplingParams
from fxcompiler.pass_manager import (DEFAULT_PASSES, PassError, PassResult, build_pass_list, get_pass)


def test_default_pipeline_and_editing():
    names = [p.name for p in build_pass_list({})]
    assert names == list(DEFAULT_PASSES)
    names = [p.name for p in build_pass_list({"passes": {"disable": ["fuse_projections"]}})]
    assert "fuse_projections" not in names

    def my_pass(gm, ctx):
        return PassResult(gm, False, {"hello": 1})

    names = [p.name for p in build_pass_list({"passes": {"insert": [(my_pass, {"before": "weight_layout"})]}})]
    assert names.index("my_pass") == names.index("weight_layout") - 1
    with pytest.raises(ValueError, match="no such pass"):
        build_pass_list({"passes": {"insert": [(my_pass, {"after": "nope"})]}})
    with pytest.raises(ValueError, match="unknown pass"):
        get_pass("nope")
    with pytest.raises(ValueError, match="unknown keys"):
        build_pass_list({"passes": {"remove": []}})


def test_user_pass_runs_inside_llm_and_changes_output(tiny_models):
    """A pass that masks the logit of one token id: greedy decoding can then never pick it."""
    path = str(tiny_models["llama"])
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = [[7, 7, 7, 7]]
    base = LLM(path, max_seq_len_to_capture=128, cache_dir=None).generate(None, sp, prompt_token_ids=prompt)
    banned = base[0].outputs[0].token_ids[0]

    def ban_token(gm, ctx):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        logits = out.args[0][0]
        with gm.graph.inserting_before(out):
            col = gm.graph.call_function(torch.ops.aten.slice.Tensor, (logits, 1, banned, banned + 1))
            gm.graph.call_function(torch.ops.aten.fill_.Scalar, (col, -1e9))
        return PassResult(gm, True, {"banned": banned})

    llm = LLM(path, max_seq_len_to_capture=128, cache_dir=None,
              compiler_config_overrides={"passes": {"insert": [(ban_token, {"after": "dce"})]}})
    assert any(h["pass"] == "ban_token" and h["banned"] == banned for h in llm.pass_history)
    out = llm.generate(None, sp, prompt_token_ids=prompt)[0].outputs[0]
    assert banned not in out.token_ids


def test_broken_pass_is_reported_with_its_name(tiny_models):
    def breaks_graph(gm, ctx):
        node = next(n for n in gm.graph.nodes if n.op == "call_function")
        node.args = (node,) + tuple(node.args[1:])  # a node that consumes itself
        return PassResult(gm, True)

    with pytest.raises(PassError, match="breaks_graph"):
        LLM(str(tiny_models["llama"]), max_seq_len_to_capture=128, cache_dir=None,
            compiler_config_overrides={"passes": {"insert": [(breaks_graph, {"after": "fold_casts"})]}})


def test_fusion_passes_preserve_outputs(tiny_models):
    """weight_layout + fuse_projections: same greedy tokens as with both disabled (fp64)."""
    path = str(tiny_models["qwen2"])
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], list(range(30, 60))]
    a = LLM(path, dtype="float64", max_seq_len_to_capture=128, cache_dir=None)
    b = LLM(path, dtype="float64", max_seq_len_to_capture=128, cache_dir=None,
            compiler_config_overrides={"passes": {"disable": ["weight_layout", "fuse_projections"]}})
    counts = {h["pass"]: h for h in a.pass_history}
    assert counts["weight_layout"]["rewritten"] == 2 * 7 + 1 and counts["fuse_projections"]["fused_groups"] == 4
    ta = [o.outputs[0].token_ids for o in a.generate(None, sp, prompt_token_ids=prompts)]
    tb = [o.outputs[0].token_ids for o in b.generate(None, sp, prompt_token_ids=prompts)]
    assert ta == tb


def _tiny_program():
    from fxcompiler import testing

    cfg = testing.TinyConfig("llama", layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, intermediate=48)
    program = testing.capture_tiny_model(cfg)
    return program, testing.context_of(program)


def _wrong_weight(gm, ctx):
    """Feeds the first linear a parameter of the wrong shape (its transpose's transpose of a
    different layer's down projection): a shape error two nodes later."""
    lin = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default)
    down = next(n for n in gm.graph.nodes if n.op == "placeholder" and "down_proj" in n.name)
    lin.args = (lin.args[0], down) + tuple(lin.args[2:])
    return PassResult(gm, True)


@pytest.mark.parametrize("mode", ["each", "end"])
def test_shape_propagation_names_pass_and_node(mode):
    from fxcompiler.pass_manager import PassManager, VerifyInstrument

    program, ctx = _tiny_program()
    manager = PassManager([get_pass("strip_asserts"), _wrong_weight, get_pass("dce")], [VerifyInstrument(mode)])
    with pytest.raises(PassError, match=r"_wrong_weight.*node 'linear"):
        manager(program.graph_module, ctx)


def test_changed_output_dtype_is_reported():
    from fxcompiler.pass_manager import PassManager, VerifyInstrument

    def to_float32(gm, ctx):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        logits = out.args[0][0]
        with gm.graph.inserting_before(out):
            cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (logits,), {"dtype": torch.float32})
        out.args = ((cast,),)
        return PassResult(gm, True)

    program, ctx = _tiny_program()
    with pytest.raises(PassError, match="to_float32.*changed the graph outputs"):
        PassManager([to_float32], [VerifyInstrument("each")])(program.graph_module, ctx)


def test_verify_env_variable(monkeypatch):
    from fxcompiler.pass_manager import VerifyInstrument, verify_instruments_from_env

    monkeypatch.setenv("FXCOMPILER_VERIFY_PASSES", "0")
    assert verify_instruments_from_env() == []
    monkeypatch.setenv("FXCOMPILER_VERIFY_PASSES", "each")
    (v,) = verify_instruments_from_env()
    assert isinstance(v, VerifyInstrument) and v.shape_prop == "each"
    monkeypatch.setenv("FXCOMPILER_VERIFY_PASSES", "sometimes")
    with pytest.raises(ValueError, match="FXCOMPILER_VERIFY_PASSES"):
        verify_instruments_from_env()


def test_a_pass_key_holds_its_source_read_once_per_pass(monkeypatch):
    """``get_pass`` keys a registered pass on its name, options and source (the compile cache's key), and reads the
    source once per registered factory (``inspect.getsource`` of a class parses its whole module)."""
    import inspect

    from fxcompiler import pass_manager as pm

    def make(k):
        class P:
            def __init__(self, **options):
                self.options = options

            def __call__(self, gm, ctx):
                return pm.PassResult(gm, False, {"k": k})
        return P

    class Q:
        def __call__(self, gm, ctx):
            return pm.PassResult(gm, True, {})

    reads = []
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: reads.append(obj) or real(obj))
    first = make(1)
    monkeypatch.setitem(pm.PASS_REGISTRY, "keyed_pass", first)
    a = pm.get_pass("keyed_pass").cache_key
    assert pm.get_pass("keyed_pass").cache_key == a and reads == [first]  # read once
    assert pm.get_pass("keyed_pass", x=1).cache_key != a  # options are in the key
    monkeypatch.setitem(pm.PASS_REGISTRY, "keyed_pass", Q)  # another body under the same name
    b = pm.get_pass("keyed_pass").cache_key
    assert b != a and a.startswith("keyed_pass:{}:") and b.startswith("keyed_pass:{}:") and reads == [first, Q]
