"""``canonicalize_indices``: compute index tensors the graph builds itself in int32 where that is exact.

Index tensors made inside the graph (``arange`` and position arithmetic on it) default to
int64. Where every value provably fits in int32 and every consumer accepts int32 indices,
computing them in int32 halves their memory traffic and lets backends with 32-bit index
units (ONNX/NPU lowerings) keep them as they are. Graph inputs are never changed: the
runtime feeds int64 ``input_ids``, positions, block tables and slots, and converting them
inside the graph would only add a cast.

The rule. A *component* is a connected set of int64 nodes made of

* sources: ``aten.arange`` (``.default``, ``.start``, ``.start_step``) with an int64 result;
* nodes whose every tensor input is in the component (the other arguments being Python
  ints or SymInt nodes): ``add``/``sub``/``mul`` (``.Tensor``, ``.Scalar``), ``neg``,
  ``remainder``/``floor_divide`` by a positive divisor, and the shape ops ``view``,
  ``reshape``, ``_unsafe_view``, ``unsqueeze``, ``squeeze.dim``, ``expand``, ``permute``,
  ``slice.Tensor``, ``select.int``, ``clone``, ``repeat``.

It is converted (the sources get ``dtype=torch.int32``; every other member follows by type
promotion) only if

1. every use of a member outside the component is an index argument of an op whose kernel
   takes int32 indices with the same result: ``index_select`` (index), ``embedding``
   (indices), ``index.Tensor`` (an entry of the indices list). Anything else (the graph
   output, a cast, a comparison, ``gather``/``index_copy``/``fxc::*`` ops, int64 arithmetic
   with another tensor) keeps the whole component in int64;
2. interval arithmetic bounds every member's values within [-2^31, 2^31 - 1]; SymInt
   bounds come from the export's shape environment (the captured graph's dynamic dims all
   have finite maxima). An unbounded size keeps the component in int64.

So results are bit-identical. On the captured models nothing qualifies today (their index
tensors are graph inputs; ``arange`` lives inside ``fxc::paged_attention``), and the pass
reports ``converted: 0``; it applies to graphs that user passes or other front ends build.

Requires: ``meta["val"]`` on nodes (fake tensors; SymInts with a shape environment).
Ensures: the same outputs, bit for bit; the signature is unchanged; converted nodes carry
int32 ``meta["val"]``. ``info["converted"]`` counts converted nodes (``sources`` the aranges).
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from fxcompiler.pass_manager import CompileContext, PassResult, register_pass

aten = torch.ops.aten

INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1

SOURCES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
ARITH = (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar,
         aten.neg.default, aten.remainder.Scalar, aten.remainder.Tensor, aten.floor_divide.default,
         aten.floor_divide.Scalar)
SHAPE = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
         aten.squeeze.dim, aten.expand.default, aten.permute.default, aten.slice.Tensor, aten.select.int,
         aten.clone.default, aten.repeat.default)
# op -> positions (in args) of the index argument that accepts int32 with identical results
CONSUMERS = {aten.index_select.default: (2,), aten.embedding.default: (1,), aten.index.Tensor: (1,)}


def _val(x):
    return x.meta.get("val") if isinstance(x, Node) else x


def _is_int64_tensor(node: Node) -> bool:
    v = _val(node)
    return isinstance(v, torch.Tensor) and v.dtype == torch.int64


def _tensor_inputs(node: Node) -> list[Node]:
    out = []
    for a in node.args:
        items = a if isinstance(a, (list, tuple)) else [a]
        out += [x for x in items if isinstance(x, Node) and isinstance(_val(x), torch.Tensor)]
    out += [x for x in node.kwargs.values() if isinstance(x, Node) and isinstance(_val(x), torch.Tensor)]
    return out


def _scalar_range(x) -> tuple[int, int] | None:
    """Bounds of a Python int or a SymInt node (from the shape environment), else None."""
    v = _val(x)
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int):
        return v, v
    if isinstance(v, torch.SymInt):
        node = v.node
        if node.shape_env is None:
            return None
        try:
            vr = node.shape_env.bound_sympy(node.expr)
            lo, hi = vr.lower, vr.upper
            if not (lo.is_finite and hi.is_finite):
                return None
            return int(lo), int(hi)
        except Exception:  # noqa: BLE001 - no usable bound: treat as unbounded
            return None
    return None


def _range(node: Node, ranges: dict[Node, tuple[int, int]]) -> tuple[int, int] | None:
    """Value bounds of a component member given its inputs' bounds; None when unknown."""
    t = node.target

    def arg(i, default=None):
        a = node.args[i] if len(node.args) > i else default
        if isinstance(a, Node) and a in ranges:
            return ranges[a]
        return _scalar_range(a) if a is not None else None

    if t in SOURCES:
        if t is aten.arange.default:
            start, end = (0, 0), arg(0)
        else:
            start, end = arg(0), arg(1)
        if start is None or end is None:
            return None
        return min(start[0], end[0]), max(start[1], end[1])
    if t in SHAPE:
        return ranges.get(node.args[0])
    if t is aten.neg.default:
        a = arg(0)
        return (-a[1], -a[0]) if a else None
    a, b = arg(0), arg(1)
    if a is None or b is None:
        return None
    if t in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar):
        alpha = node.kwargs.get("alpha", 1)
        if not isinstance(alpha, int) or isinstance(alpha, bool):
            return None
        b = (min(alpha * b[0], alpha * b[1]), max(alpha * b[0], alpha * b[1]))
        if t in (aten.add.Tensor, aten.add.Scalar):
            return a[0] + b[0], a[1] + b[1]
        return a[0] - b[1], a[1] - b[0]
    if t in (aten.mul.Tensor, aten.mul.Scalar):
        p = [a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1]]
        return min(p), max(p)
    if b[0] <= 0:  # remainder / floor_divide: positive divisors only
        return None
    if t in (aten.remainder.Scalar, aten.remainder.Tensor):
        return 0, b[1] - 1
    q = [a[0] // b[0], a[0] // b[1], a[1] // b[0], a[1] // b[1]]
    return min(q), max(q)


def _is_index_use(user: Node, member: Node) -> bool:
    positions = CONSUMERS.get(user.target) if user.op == "call_function" else None
    if positions is None:
        return False
    uses = 0
    for i in positions:
        a = user.args[i] if len(user.args) > i else None
        items = a if isinstance(a, (list, tuple)) else [a]
        uses += sum(x is member for x in items)
    total = sum(x is member for a in user.args for x in (a if isinstance(a, (list, tuple)) else [a]))
    total += sum(v is member for v in user.kwargs.values())
    return uses > 0 and uses == total


@register_pass("canonicalize_indices")
class CanonicalizeIndicesPass:
    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        graph = gm.graph
        members: list[Node] = []
        in_set: set[Node] = set()
        for node in graph.nodes:
            if node.op != "call_function" or not _is_int64_tensor(node):
                continue
            if node.target in SOURCES:
                ok = True
            elif node.target in ARITH or node.target in SHAPE:
                ins = _tensor_inputs(node)
                ok = bool(ins) and all(x in in_set for x in ins)
            else:
                ok = False
            if ok:
                members.append(node)
                in_set.add(node)

        # connected components of the member set (union-find over member→member edges)
        parent = {n: n for n in members}

        def find(n):
            while parent[n] is not n:
                parent[n] = parent[parent[n]]
                n = parent[n]
            return n

        for n in members:
            for x in _tensor_inputs(n):
                if x in in_set:
                    parent[find(n)] = find(x)
        components: dict[Node, list[Node]] = {}
        for n in members:
            components.setdefault(find(n), []).append(n)

        converted = sources = rejected = 0
        for comp in components.values():
            comp_set = set(comp)
            ranges: dict[Node, tuple[int, int]] = {}
            ok = True
            for n in comp:  # graph order: inputs before users
                r = _range(n, ranges)
                if r is None or r[0] < INT32_MIN or r[1] > INT32_MAX:
                    ok = False
                    break
                ranges[n] = r
                if any(u not in comp_set and not _is_index_use(u, n) for u in n.users):
                    ok = False
                    break
            if not ok or not any(u not in comp_set for n in comp for u in n.users):
                rejected += ok is False
                continue
            for n in comp:
                if n.target in SOURCES:
                    n.kwargs = {**n.kwargs, "dtype": torch.int32}
                    sources += 1
                n.meta["val"] = _as_int32(n.meta["val"])
                converted += 1
        return PassResult(gm, converted > 0, {"converted": converted, "sources": sources,
                                              "kept_int64_components": rejected})


def _as_int32(val: torch.Tensor) -> torch.Tensor:
    mode = getattr(val, "fake_mode", None)
    if mode is not None:
        with mode:
            return val.to(torch.int32)
    return val.to(torch.int32)
