"""``cse``: merged graphs compute the same logits and KV caches (fp64); mutations, random ops
and typed constants keep nodes apart."""
from __future__ import annotations

from collections import Counter

import torch
from hypothesis import HealthCheck, given, settings
from torch.fx import Graph, GraphModule

from fxcompiler import testing
from fxcompiler.pass_manager import get_pass

aten = torch.ops.aten


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=testing.model_configs(max_layers=2), bucket=testing.buckets())
def test_cse_preserves_semantics(cfg, bucket):
    program = testing.capture_tiny_model(cfg)
    inputs = testing.example_inputs(program, bucket)
    testing.assert_pass_preserves_semantics(get_pass("cse"), program, inputs)
    # after decompose(model_rewrite) every linear has its own sym_size → mul → view: many merges
    info = testing.assert_pass_preserves_semantics(get_pass("cse"), program, inputs,
                                                   passes_before=(get_pass("decompose", model_rewrite=True),))
    groups = 1 if cfg.arch == "gpt2" else 2  # linears that share an activation: q/k/v, gate/up
    assert info["eliminated"] >= (0 if cfg.arch == "gpt2" else groups * cfg.layers * 3)


def _ops(gm) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def test_cse_counts_on_decomposed_llama():
    cfg = testing.TinyConfig("llama", layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, intermediate=48)
    program = testing.capture_tiny_model(cfg)
    ctx = testing.context_of(program)
    gm = get_pass("decompose", model_rewrite=True)(program.graph_module, ctx).graph_module
    before = _ops(gm)
    info = get_pass("cse")(gm, ctx).info
    after = _ops(gm)
    # q/k/v share one view of the normed activation (2 of 3 views go), gate/up too (1 of 2):
    # each view comes with 2 sym_size and 1 mul; plus the cos/sin unsqueeze of the second layer
    assert info["by_op"] == {"aten.sym_size.int": 2 * 3 * 2, "<built-in function mul>": 3 * 2,
                             "aten.view.default": 3 * 2, "aten.unsqueeze.default": 2}
    assert info["eliminated"] == sum(before.values()) - sum(after.values()) == 26
    assert after["fxc.paged_attention.default"] == 2


def _module(build) -> GraphModule:
    g = Graph()
    build(g)
    return GraphModule(torch.nn.Module(), g)


def _run_cse(gm, *args):
    expected = gm(*[a.clone() for a in args])
    info = get_pass("cse")(gm, None).info
    gm.recompile()
    gm.graph.lint()
    got = gm(*[a.clone() for a in args])
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    return info


def test_no_merge_across_a_mutation():
    def build(g):
        x = g.placeholder("x")
        a = g.call_function(aten.mul.Tensor, (x, 2))
        g.call_function(aten.add_.Tensor, (x, 1))
        b = g.call_function(aten.mul.Tensor, (x, 2))  # reads the mutated x: differs from a
        c = g.call_function(aten.mul.Tensor, (x, 2))  # same as b
        v1 = g.call_function(aten.view.default, (x, [-1]))  # views of a mutated input: never merged
        v2 = g.call_function(aten.view.default, (x, [-1]))
        g.output((a, b, c, v1, v2))

    info = _run_cse(_module(build), torch.randn(3, 4))
    assert info["eliminated"] == 1 and info["by_op"] == {"aten.mul.Tensor": 1}


def test_no_merge_of_buffers_written_in_place():
    def build(g):
        x = g.placeholder("x")
        z1 = g.call_function(aten.zeros_like.default, (x,))
        g.call_function(aten.add_.Tensor, (z1, x))
        z2 = g.call_function(aten.zeros_like.default, (x,))  # must stay zeros
        s1 = g.call_function(aten.sum.default, (z1,))
        s2 = g.call_function(aten.sum.default, (z1,))  # same version of z1: merges
        g.output((z1, z2, s1, s2))

    info = _run_cse(_module(build), torch.randn(3, 4))
    assert info["by_op"] == {"aten.sum.default": 1}


def test_random_ops_and_typed_constants_stay_apart():
    def build(g):
        x = g.placeholder("x")
        n = g.placeholder("n")
        r1 = g.call_function(aten.rand_like.default, (x,))
        r2 = g.call_function(aten.rand_like.default, (x,))
        i = g.call_function(aten.add.Tensor, (n, 1))
        f = g.call_function(aten.add.Tensor, (n, 1.0))
        t = g.call_function(aten.add.Tensor, (n, True))
        i2 = g.call_function(aten.add.Tensor, (n, 1))  # same as i
        g.output((r1, r2, i, f, t, i2))

    gm = _module(build)
    info = get_pass("cse")(gm, None).info
    gm.recompile()
    assert info["by_op"] == {"aten.add.Tensor": 1}
    ops = _ops(gm)
    assert ops["aten.rand_like.default"] == 2 and ops["aten.add.Tensor"] == 3
    r1, r2, i, f, t, i2 = gm(torch.zeros(3), torch.zeros(2, dtype=torch.int64))
    assert not torch.equal(r1, r2) and i is i2
    assert i.dtype == t.dtype == torch.int64 and f.dtype == torch.float32 and int(i[0]) == int(t[0]) == 1


def test_paged_attention_calls_never_merge():
    cfg = testing.TinyConfig("llama", layers=1, hidden=32, heads=4, kv_heads=2, vocab=64, intermediate=48)
    program = testing.capture_tiny_model(cfg)
    gm = program.graph_module
    attn = next(n for n in gm.graph.nodes if n.target is torch.ops.fxc.paged_attention.default)
    with gm.graph.inserting_after(attn):  # a second, identical call: writes the cache again, stays
        dup = gm.graph.call_function(attn.target, attn.args, attn.kwargs)
        dup.meta = dict(attn.meta)
    gm.recompile()
    info = get_pass("cse")(gm, testing.context_of(program)).info
    assert _ops(gm)["fxc.paged_attention.default"] == 2
    assert "fxc.paged_attention.default" not in info["by_op"]
