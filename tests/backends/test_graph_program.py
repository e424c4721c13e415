"""The fx backend's native executor (backends/graph_program.py): same values as the graphs' Python code."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import graph_program
from backends.fx import FxExecutable

aten = torch.ops.aten
PROMPTS = [[5, 17, 33, 2, 90], list(range(3, 40))]  # prefill of two lengths, then batched decode


def _program(gm: torch.fx.GraphModule, num_inputs: int, params=()):
    """A one-supertask plan: bound params first, then the user inputs; output slot after them."""
    out_slot = num_inputs
    return graph_program.compile_plan([(gm, list(params), list(range(num_inputs)), [out_slot])], num_inputs, out_slot)


def _run_both(gm: torch.fx.GraphModule, inputs, params=()):
    prog = _program(gm, len(inputs), params)
    want = gm(*params, *inputs)
    want = want[0] if isinstance(want, (tuple, list)) else want
    got = prog.run(list(inputs))[0]
    return got, want


def _graph(build) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    out = build(g)
    g.output((out,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.fixture(scope="module", autouse=True)
def _module_built():
    if graph_program.program_module() is None:
        pytest.fail(f"native executor did not build: {graph_program._state['error']}")


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 4), t=st.integers(1, 5), heads=st.integers(1, 4), d=st.sampled_from([2, 4, 8]),
       scale=st.floats(-2, 2, allow_nan=False), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_views_splits_sizes_scalars_and_kwargs_match_python(b, t, heads, d, scale, dtype):
    """The node kinds of a transformer block: sym_size, int arithmetic, view with node-valued sizes,
    split (list return) + getitem, permute, cat (tensor list), a Python scalar for a Tensor argument,
    keyword-only arguments and defaults, a multi-return op."""

    def build(g):
        x, w = g.placeholder("x"), g.placeholder("w")
        bs = g.call_function(aten.sym_size.int, (x, 0))
        ts = g.call_function(aten.sym_size.int, (x, 1))
        n = g.call_function(operator.mul, (bs, ts))
        parts = g.call_function(aten.split_with_sizes.default, (x, [heads * d, heads * d], -1))
        q, k = g.call_function(operator.getitem, (parts, 0)), g.call_function(operator.getitem, (parts, 1))
        qv = g.call_function(aten.permute.default, (g.call_function(aten.view.default, (q, [bs, ts, -1, d])),
                                                    [0, 2, 1, 3]))
        kv = g.call_function(aten.view.default, (k, [n, heads * d]))
        scaled = g.call_function(aten.mul.Tensor, (kv, scale))
        wide = g.call_function(aten.cat.default, ([scaled, scaled],), {"dim": -1})
        mx = g.call_function(aten.max.dim, (wide, -1, True))
        vals = g.call_function(operator.getitem, (mx, 0))
        idx = g.call_function(operator.getitem, (mx, 1))
        f32 = g.call_function(aten._to_copy.default, (vals,), {"dtype": torch.float32})
        summed = g.call_function(aten.add.Tensor, (f32, g.call_function(aten._to_copy.default, (idx,),
                                                                        {"dtype": torch.float32})), {"alpha": 2})
        flat_q = g.call_function(aten.reshape.default, (qv, [-1]))
        mm = g.call_function(aten.mm.default, (g.call_function(aten._to_copy.default, (kv,), {"dtype": torch.float32}),
                                               w))
        return g.call_function(aten.cat.default, ([g.call_function(aten.reshape.default, (summed, [-1])),
                                                   g.call_function(aten._to_copy.default, (flat_q,),
                                                                   {"dtype": torch.float32}),
                                                   g.call_function(aten.reshape.default, (mm, [-1]))],))

    gm = _graph(build)
    x = torch.randn(b, t, 2 * heads * d).to(dtype)
    w = torch.randn(heads * d, 3)
    got, want = _run_both(gm, [x, w])
    assert torch.equal(got, want)


def test_in_place_ops_run_in_graph_order_on_the_callers_tensors():
    def build(g):
        cache, idx, val = g.placeholder("cache"), g.placeholder("idx"), g.placeholder("val")
        before = g.call_function(aten.clone.default, (cache,))
        g.call_function(aten.index_copy_.default, (cache, 0, idx, val))
        after = g.call_function(aten.clone.default, (cache,))
        return g.call_function(aten.sub.Tensor, (after, before))

    gm = _graph(build)
    cache = torch.zeros(5, 3)
    idx, val = torch.tensor([1, 3]), torch.ones(2, 3)
    got = _program(gm, 3).run([cache, idx, val])[0]
    assert torch.equal(cache[[1, 3]], val) and cache.sum() == 6  # the caller's tensor was written
    assert torch.equal(got, cache)


def test_bound_parameters_and_get_attr_constants():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.arange(6.0).reshape(2, 3))

    g = torch.fx.Graph()
    w, x = g.placeholder("w"), g.placeholder("x")
    t = g.get_attr("table")
    g.output((g.call_function(aten.add.Tensor, (g.call_function(aten.mm.default, (x, w)), t)),))
    gm = torch.fx.GraphModule(M(), g)
    w_val, x_val = torch.randn(4, 3), torch.randn(2, 4)
    got = _program(gm, 1, params=[w_val]).run([x_val])[0]
    assert torch.equal(got, x_val @ w_val + gm.table)


def test_a_chain_of_supertasks_passes_values_through_named_slots():
    def stage(g):
        x, w = g.placeholder("w"), g.placeholder("x")
        return g.call_function(aten.relu.default, (g.call_function(aten.mm.default, (w, x)),))

    gm = _graph(stage)
    w1, w2 = torch.randn(4, 4), torch.randn(4, 4)
    x = torch.randn(3, 4)
    # plan slots: 0 = user input, 1 = after stage 1, 2 = after stage 2
    prog = graph_program.compile_plan([(gm, [w1], [0], [1]), (gm, [w2], [1], [2])], 1, 2)
    assert torch.equal(prog.run([x])[0], torch.relu(torch.relu(x @ w1) @ w2))


def test_operator_errors_reach_the_caller():
    gm = _graph(lambda g: g.call_function(aten.view.default, (g.placeholder("x"), [7, -1])))
    prog = _program(gm, 1)
    with pytest.raises(RuntimeError, match="invalid for input of size") as err:
        prog.run([torch.zeros(4, 3)])
    assert "in graph node supertask0/view" in str(err.value)  # which node of which supertask failed
    with pytest.raises(ValueError, match="expected 1 input tensors, got 2"):
        prog.run([torch.zeros(1), torch.zeros(1)])


@pytest.mark.parametrize("make", [
    lambda g: g.call_function(torch.relu, (g.placeholder("x"),)),  # a Python function, not an OpOverload
    lambda g: g.call_function(aten.relu, (g.placeholder("x"),)),  # an overload packet
    lambda g: g.call_method("relu", (g.placeholder("x"),)),
])
def test_unsupported_nodes_are_reported(make):
    with pytest.raises(graph_program.UnsupportedGraph):
        _program(_graph(make), 1)


def _tiny_pipeline(tiny_models, arch="llama"):
    from fxcompiler import LLM

    llm = LLM(str(tiny_models[arch]), dtype="float32", max_seq_len_to_capture=64, cache_dir=None)
    return llm


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_llm_pipelines_run_natively_and_match_the_python_plan(arch, tiny_models):
    """Every graph the default pipeline builds is runnable natively (so the parity tests exercise this
    executor), and a step's logits equal those of the Python plan over the same inputs."""
    from fxcompiler import SamplingParams

    llm = _tiny_pipeline(tiny_models, arch)
    # the second run must compute the same rows: with the prefix cache its prefills would be shorter
    # (steps compute their real rows only), and a linear's rounding may depend on its row count
    llm.engine.configure(enable_prefix_caching=False)
    exes = list({id(e): e for e in llm.engine.runner.executables.values()}.values())
    assert all(isinstance(e, FxExecutable) and e.executor == "native" for e in exes), \
        [e.fallback_reason for e in exes]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    native = llm.generate(None, sp, prompt_token_ids=PROMPTS)
    programs = [e.program for e in exes]
    try:
        for e in exes:
            e.program = None
        python = llm.generate(None, sp, prompt_token_ids=PROMPTS)
    finally:
        for e, p in zip(exes, programs):
            e.program = p
    for a, b in zip(native, python):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == b.outputs[0].cumulative_logprob


def test_dfg_pipelines_run_natively(tiny_models):
    """dfg supertasks are converted back to fx graphs for the fx executor: those run natively too."""
    from fxcompiler import LLM

    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_seq_len_to_capture=64, cache_dir=None,
              comp_supertask_kind="dfg")
    exe = next(iter(llm.engine.runner.executables.values()))
    assert exe.supertask_kind == "dfg" and exe.executor == "native", exe.fallback_reason


def test_native_executor_can_be_switched_off(tiny_models, monkeypatch):
    monkeypatch.setenv("FXCOMPILER_NATIVE_EXECUTOR", "0")
    llm = _tiny_pipeline(tiny_models)
    exe = next(iter(llm.engine.runner.executables.values()))
    assert exe.executor == "python" and exe.fallback_reason == "disabled"
