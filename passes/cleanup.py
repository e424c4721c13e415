"""Clean-up passes that only remove work: ``strip_asserts``, ``fold_casts``, ``dce``.

Requires: an ATen graph from :mod:`fxcompiler.capture` with ``meta["val"]`` on nodes.
Ensures: the same outputs for the same inputs; the graph signature is unchanged.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from fxcompiler.pass_manager import CompileContext, PassResult, register_pass

aten = torch.ops.aten

_ASSERT_TARGETS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default,
                   torch.ops.aten.sym_constrain_range_for_size.default}


@register_pass("strip_asserts")
class StripAssertsPass:
    """Remove export-time metadata assertions (runtime no-ops that still cost a dispatch each)."""

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        removed = 0
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target in _ASSERT_TARGETS and not node.users:
                gm.graph.erase_node(node)
                removed += 1
        return PassResult(gm, removed > 0, {"removed": removed})


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


@register_pass("fold_casts")
class FoldCastsPass:
    """Drop casts to the dtype a tensor already has, and multiplications by exactly 1.

    ``x.to(x.dtype)`` and ``x * 1.0`` return ``x`` (or an equal copy); removing them keeps
    results bit-identical while saving a dispatch per node.
    """

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        folded = 0
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            src = node.args[0] if node.args else None
            sv, nv = _val(src), _val(node)
            if sv is None or nv is None or not isinstance(sv, torch.Tensor) or not isinstance(nv, torch.Tensor):
                continue
            same = sv.dtype == nv.dtype and sv.device == nv.device and _same_shape(sv, nv)
            if node.target in (aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten._to_copy.default) and same:
                if node.target is aten._to_copy.default and node.kwargs.get("memory_format") is not None:
                    continue
                node.replace_all_uses_with(src)
                gm.graph.erase_node(node)
                folded += 1
            elif node.target in (aten.mul.Tensor, aten.mul.Scalar) and len(node.args) == 2 \
                    and isinstance(node.args[1], (int, float)) and node.args[1] == 1 and same:
                node.replace_all_uses_with(src)
                gm.graph.erase_node(node)
                folded += 1
        return PassResult(gm, folded > 0, {"folded": folded})


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Shape equality that never guards: ``==`` on symbolic sizes would record the export
    example's sizes as facts in the shape environment every copy of the capture shares."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    return a.dim() == b.dim() and statically_known_true(sym_eq(tuple(a.shape), tuple(b.shape)))


@register_pass("dce")
class DeadCodeEliminationPass:
    """Remove side-effect-free nodes whose results nobody uses, then unused parameter inputs."""

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        before = len(gm.graph.nodes)
        gm.graph.eliminate_dead_code(is_impure_node=_is_impure)
        dropped = ctx.drop_unused_params(gm)
        removed = before - len(gm.graph.nodes)
        return PassResult(gm, removed > 0, {"removed_nodes": removed, "removed_params": dropped})


def _is_impure(node: torch.fx.Node) -> bool:
    if node.op in ("placeholder", "output"):
        return True
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        if schema.is_mutable or target.namespace == "fxc":
            return True
    return node.is_impure()
