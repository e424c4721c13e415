"""Deliberately wrong passes for the pass-framework tests (importable, so reproducers can name them)."""
from __future__ import annotations

import torch

from fxcompiler.pass_manager import PassResult

aten = torch.ops.aten


def negate_eps(gm, ctx):
    """Sign flip in every RMSNorm: ``rsqrt(mean + eps)`` becomes ``rsqrt(-(mean + eps))`` (NaN logits)."""
    n = 0
    for node in list(gm.graph.nodes):
        if node.target is aten.rsqrt.default:
            with gm.graph.inserting_before(node):
                neg = gm.graph.call_function(aten.neg.default, (node.args[0],))
            neg.meta["val"] = node.args[0].meta.get("val")
            node.args = (neg,)
            n += 1
    return PassResult(gm, n > 0, {"negated": n})


def scale_first_silu(gm, ctx):
    """Doubles the input of the first ``silu`` (a wrong result at one node)."""
    node = next(n for n in gm.graph.nodes if n.target in (aten.silu.default, torch.ops.fxc.silu_mul.default))
    with gm.graph.inserting_before(node):
        doubled = gm.graph.call_function(aten.mul.Tensor, (node.args[0], 2.0))
    doubled.meta["val"] = node.args[0].meta.get("val")
    node.args = (doubled, *node.args[1:])
    return PassResult(gm, True, {"scaled": node.name})


def wrong_shape(gm, ctx):
    """Feeds the first matmul-like node a parameter of another layer's down projection (shape error)."""
    lin = next(n for n in gm.graph.nodes if n.target in (aten.linear.default, aten.matmul.default, aten.mm.default)
               and n.args[1].op == "placeholder")
    down = next(n for n in gm.graph.nodes if n.op == "placeholder" and "down_proj" in n.name)
    lin.args = (lin.args[0], down) + tuple(lin.args[2:])
    return PassResult(gm, True)
