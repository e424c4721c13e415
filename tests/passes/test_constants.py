"""``constants``: weights folded into the graph as constants, or kept as param-file inputs."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from fxcompiler import testing
from fxcompiler.pass_manager import DEFAULT_PASSES, get_pass
from passes.constants import constant_tensors

BEFORE = tuple(DEFAULT_PASSES[:-1])


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=testing.model_configs(), bucket=testing.buckets())
def test_embedding_constants_preserves_semantics(cfg, bucket):
    program = testing.capture_tiny_model(cfg)
    inputs = testing.example_inputs(program, bucket)
    info = testing.assert_pass_preserves_semantics(get_pass("constants", embed_all_constants_into_graph=True),
                                                   program, inputs, passes_before=tuple(get_pass(n) for n in BEFORE))
    assert info["embedded"] > 0 and info["param_inputs"] == 0


def test_embedding_moves_every_parameter_into_the_graph():
    cfg = testing.TinyConfig("qwen2", layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, intermediate=48)
    program = testing.capture_tiny_model(cfg)
    ctx = testing.context_of(program)
    n_params = sum(s.kind == "param" for s in ctx.input_specs)
    originals = dict(ctx.params)
    result = get_pass("constants", embed_all_constants_into_graph=True)(program.graph_module, ctx)
    gm = result.graph_module
    gm.recompile()
    assert result.info["embedded"] == len(originals) and n_params >= len(originals)
    assert not ctx.params and all(s.kind == "user" for s in ctx.input_specs)
    assert not any(n.op == "placeholder" and n.name.startswith("p_") for n in gm.graph.nodes)
    consts = constant_tensors(gm)
    assert set(consts) == set(originals) and all(consts[k] is originals[k] for k in consts)
    assert sum(n.op == "get_attr" for n in gm.graph.nodes) == n_params


def test_default_keeps_parameters_as_inputs():
    cfg = testing.TinyConfig("llama", layers=1, hidden=32, heads=4, kv_heads=2, vocab=64, intermediate=48)
    program = testing.capture_tiny_model(cfg)
    ctx = testing.context_of(program)
    n_params = sum(s.kind == "param" for s in ctx.input_specs)
    result = get_pass("constants")(program.graph_module, ctx)
    assert not result.modified and result.info == {"embedded": 0, "param_inputs": n_params,
                                                   "bytes": result.info["bytes"]}
    ctx.options["embed_all_constants_into_graph"] = True  # the LLM(...) argument arrives as an option
    assert get_pass("constants")(program.graph_module, ctx).info["embedded"] > 0
