"""Numeric comparison of graphs for the pass checks: which output moved and how (NaN/Inf named
as such, never "changed by nan"), and which node is the first whose value diverges from a
reference run of another version of the graph (nodes are paired by name: a pass keeps the
names of the nodes it does not replace).

Used by :class:`fxcompiler.instruments.NumericCheckInstrument`, the build-time finite check
(:class:`fxcompiler.instruments.FiniteCheckInstrument`) and ``fxcompiler compile --bisect``.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Interpreter, Node

from .pass_manager import CompileContext


def graph_snapshot(gm: GraphModule) -> GraphModule:
    """A cheap copy of ``gm`` that later in-place edits of ``gm`` do not reach (nodes copied, their
    ``meta`` dicts shallow-copied, attributes shared)."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return GraphModule(gm, graph)


def describe_difference(name: str, got: torch.Tensor, exp: torch.Tensor, tol: float) -> str | None:
    """None when ``got`` matches ``exp`` within ``tol`` (max abs difference relative to max |exp|),
    else what is wrong, in words."""
    if got.shape != exp.shape:
        return f"changed the shape of {name} from {list(exp.shape)} to {list(got.shape)}"
    if not got.is_floating_point():
        bad = int((got != exp).sum())
        return f"changed {bad} of {got.numel()} values of {name}" if bad else None
    g, e = got.double(), exp.double()
    g_bad, e_bad = ~torch.isfinite(g), ~torch.isfinite(e)
    if bool((g_bad & ~e_bad).any()):
        nan, inf = int(torch.isnan(g).logical_and(~e_bad).sum()), int(torch.isinf(g).logical_and(~e_bad).sum())
        return f"made {name} non-finite ({nan} NaN, {inf} Inf of {g.numel()} values; the reference is finite there)"
    ok = ~(g_bad | e_bad)
    if not bool(ok.any()):
        return None
    scale = e[ok].abs().max().item() + 1e-6
    err = (g[ok] - e[ok]).abs().max().item() / scale
    if err <= tol:
        return None
    return f"changed {name} by {err:.3g} (max abs difference relative to max |reference|; tolerance {tol:g})"


class _Recorder(Interpreter):
    def __init__(self, gm: GraphModule):
        super().__init__(gm)
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, n: Node):
        result = super().run_node(n)
        if n.op == "call_function" and isinstance(result, torch.Tensor):
            self.values[n.name] = result.detach().clone()
        return result


def record_values(gm: GraphModule, ctx: CompileContext, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every ``call_function`` node's tensor value (cloned) when ``gm`` runs on ``inputs``."""
    fresh = {k: v.to(ctx.geometry.dtype) if "_cache_" in k else v.clone() for k, v in inputs.items()}
    args = [ctx.params[s.target] if s.kind == "param" else fresh[s.target] for s in ctx.input_specs]
    rec = _Recorder(gm)
    with torch.no_grad():
        rec.run(*args)
    return rec.values


def first_divergent_node(reference: dict[str, torch.Tensor], gm: GraphModule, ctx: CompileContext,
                         inputs: dict[str, torch.Tensor], tol: float, made_by: str | None = None) -> str | None:
    """The first node of ``gm`` (graph order) whose value, on ``inputs``, differs from the node of the
    same name in ``reference`` (from :func:`record_values`), described with the nodes feeding it that
    ``made_by`` (a pass name) created; None when every paired node agrees."""
    values = record_values(gm, ctx, inputs)
    for n in gm.graph.nodes:
        if n.name not in values or n.name not in reference:
            continue
        what = describe_difference(n.name, values[n.name], reference[n.name], tol)
        if what is None:
            continue
        new_inputs = [a.name for a in n.all_input_nodes if a.name not in reference]
        tagged = [a.name for a in n.all_input_nodes if made_by and a.meta.get("fxc_pass") == made_by]
        feeders = sorted(set(new_inputs) | set(tagged))
        src = f"; its inputs {feeders} are new or rewritten" if feeders else ""
        return f"first divergent node {n.name!r} ({n.format_node()}): {what}{src}"
    return None


def first_nonfinite_node(gm: GraphModule, ctx: CompileContext, inputs: dict[str, torch.Tensor]) -> str | None:
    """The first node of ``gm`` whose value on ``inputs`` holds NaN/Inf (with its inputs finite), or None."""
    values = record_values(gm, ctx, inputs)
    for n in gm.graph.nodes:
        v = values.get(n.name)
        if v is not None and v.is_floating_point() and not bool(torch.isfinite(v).all()):
            return f"node {n.name!r} ({n.format_node()}, made by pass {n.meta.get('fxc_pass', '?')!r})"
    return None
