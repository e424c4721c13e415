"""Fusion passes that cut the number of kernels a step dispatches.

* ``fuse_rms_norm``: the decomposed RMSNorm transformers emits (``pow → mean → add eps →
  rsqrt → mul x → mul weight``, with no dtype casts in between) becomes one ``fxc::rms_norm``.
* ``fuse_silu_mul``: ``silu(gate) * up`` (the gated MLP) becomes one ``fxc::silu_mul``.
* ``fuse_rope``: ``x * cos + cat(-x[..., h:], x[..., :h]) * sin`` (transformers'
  ``apply_rotary_pos_emb``) becomes one ``fxc::rope``; the dead pieces go at the next ``dce``.
* ``fuse_projections``: matmuls (``matmul`` or ``mm``) that read the same activation with
  different parameter weights (q/k/v, gate/up) become one matmul with the weights
  concatenated along N, followed by a split; one bigger GEMV streams memory better than
  three small ones. Views of one tensor to the same shape count as the same activation
  (each linear that ``decompose(model_rewrite=True)`` splits makes its own ``view``).

* ``fuse_linear_silu_mul``: ``fxc::silu_mul`` of the halves of a fused gate/up ``fxc::linear_w4a8``,
  ``fxc::linear_w8`` or ``fxc::linear_w4`` becomes one ``fxc::linear_w4a8_silu_mul`` / ``fxc::linear_w8_silu_mul`` /
  ``fxc::linear_w4_silu_mul`` (the product in the
  linear's epilogue); runs after ``quantize``.
* ``fuse_linear_add``: ``residual + fxc::linear_w4a8(...)`` (or ``fxc::linear_w8``, ``fxc::linear_w4``, and the
  float32 / bfloat16 ``fxc::linear`` and ``fxc::linear_by_m``) becomes one ``fxc::<op>_add`` (the sum in the linear's
  output loop); runs after ``quantize`` and ``lower_cpu_kernels``.

* ``fuse_qkv_attention``: the heads of a fused q/k/v projection (``split_with_sizes`` → ``view`` →
  ``permute``), the rotary embedding of q and k (``fxc::rope``), ``fxc::paged_attention`` and the
  ``[B, S, Hq·D]`` view of its result become one ``fxc::qkv_paged_attention`` (the ~15 nodes a layer
  that a decode step otherwise dispatches one by one). Runs after ``fuse_projections`` (which makes the
  split) and a ``dce`` (the nodes of the chain must have no users but the next link). Bias adds
  between the split and the views (Qwen2) become one add of the concatenated biases on the projection.

Requires: ``weight_layout`` has run (for ``fuse_projections``); ``meta["val"]`` on nodes.
Ensures: the same function up to fp accumulation order. Signature: ``fuse_projections``
replaces each group's weights by one concatenated parameter input.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

import fxcompiler.ops.fused  # noqa: F401  (defines fxc::rms_norm / fxc::silu_mul / fxc::rope)
from fxcompiler.ops.linear import NB  # (and defines fxc::linear_w8_silu_mul / fxc::linear_w8_add / fxc::linear_add)
import fxcompiler.ops.quant_linear  # noqa: F401  (defines fxc::linear_w4_silu_mul / fxc::linear_w4_add)
from fxcompiler.ops.w4a8_linear import NB4  # (and defines fxc::linear_w4a8_silu_mul / fxc::linear_w4a8_add)
from fxcompiler.pass_manager import CompileContext, PassRequirements, PassResult, register_pass
from fxcompiler.pattern_matcher import PatternMatcherPass, Scalar

aten = torch.ops.aten


def _is(node, target) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def _call_before(graph, anchor: Node, target, args: tuple, val) -> Node:
    """Insert ``target(*args)`` before ``anchor`` with value metadata ``val``."""
    with graph.inserting_before(anchor):
        new = graph.call_function(target, args)
    new.meta["val"] = val
    return new


def _replace_with_call(graph, old: Node, target, args: tuple) -> Node:
    """Insert ``target(*args)`` before ``old``, give it ``old``'s value metadata, reroute ``old``'s users."""
    new = _call_before(graph, old, target, args, _val(old))
    old.replace_all_uses_with(new)
    return new


def _concatenated_param(ctx: CompileContext, gm: GraphModule, placeholders: list[Node], dim: int) -> Node:
    """A new parameter input: the values of ``placeholders`` concatenated along ``dim``, named ``a+b+...``."""
    names = [ctx.placeholder_spec(p).target for p in placeholders]
    return ctx.add_param_input(gm, "+".join(names), torch.cat([ctx.param_of(p) for p in placeholders], dim=dim))


def _rms_norm(x, w, eps, dim):
    return x * torch.rsqrt(x.pow(2).mean(dim, keepdim=True) + eps) * w


def _rms_norm_ok(m) -> bool:
    """A float eps, the last dim, a 1-D weight of x's width and dtype (no casts inside the norm)."""
    xv, wv = m.val("x"), m.val("w")
    return xv is not None and wv is not None and isinstance(m["eps"], float) and m["dim"] in (-1, xv.dim() - 1) \
        and wv.dim() == 1 and wv.shape[0] == xv.shape[-1] and wv.dtype == xv.dtype


@register_pass("fuse_rms_norm")
class FuseRmsNormPass(PatternMatcherPass):
    def __init__(self):
        super().__init__("fuse_rms_norm", count_key="fused")
        self.register_replacement(_rms_norm, lambda x, w, eps, dim: torch.ops.fxc.rms_norm(x, w, eps),
                                  [torch.empty(2, 8), torch.empty(8), Scalar("eps"), Scalar("dim", -1)], _rms_norm_ok)


def _same_shape_and_dtype(m) -> bool:
    gv, uv = m.val("gate"), m.val("up")
    return gv is not None and uv is not None and tuple(gv.shape) == tuple(uv.shape) and gv.dtype == uv.dtype


@register_pass("fuse_silu_mul")
class FuseSiluMulPass(PatternMatcherPass):
    def __init__(self):
        super().__init__("fuse_silu_mul", count_key="fused")
        self.register_replacement(lambda gate, up: torch.nn.functional.silu(gate) * up,
                                  lambda gate, up: torch.ops.fxc.silu_mul(gate, up),
                                  [torch.empty(2, 8), torch.empty(2, 8)], _same_shape_and_dtype, name="silu_mul")


def _rotate_half_of(cat: Node) -> Node | None:
    """``x`` if ``cat`` is ``cat([neg(x[..., h:]), x[..., :h]], -1)`` with h = D/2, else None."""
    if not _is(cat, aten.cat.default) or len(cat.args[0]) != 2:
        return None
    neg, lo = cat.args[0]
    if not _is(neg, aten.neg.default) or not _is(lo, aten.slice.Tensor):
        return None
    hi = neg.args[0]
    if not _is(hi, aten.slice.Tensor) or hi.args[0] is not lo.args[0]:
        return None
    x = lo.args[0]
    xv = _val(x)
    if xv is None:
        return None
    last = xv.dim() - 1
    dim = cat.args[1] if len(cat.args) > 1 else 0
    d = xv.shape[-1]
    if dim not in (-1, last) or hi.args[1] not in (-1, last) or lo.args[1] not in (-1, last) or d % 2:
        return None
    h = d // 2
    if tuple(lo.args[2:4]) != (0, h) or hi.args[2] != h or (len(hi.args) > 3 and hi.args[3] < d):
        return None
    return x


@register_pass("fuse_rope")
class FuseRopePass:
    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        graph, fused = gm.graph, 0
        for add in [n for n in graph.nodes if _is(n, aten.add.Tensor) and len(n.args) == 2]:
            a, b = add.args
            if not (_is(a, aten.mul.Tensor) and _is(b, aten.mul.Tensor)):
                continue
            rot = None
            for m_cos, m_sin in ((a, b), (b, a)):
                for cat, sin in ((m_sin.args[0], m_sin.args[1]), (m_sin.args[1], m_sin.args[0])):
                    x = _rotate_half_of(cat) if isinstance(cat, Node) else None
                    if x is None or x not in m_cos.args:
                        continue
                    cos = m_cos.args[1] if m_cos.args[0] is x else m_cos.args[0]
                    rot = (x, cos, sin)
                    break
                if rot:
                    break
            if rot is None:
                continue
            x, cos, sin = rot
            xv, cv, sv = _val(x), _val(cos), _val(sin)
            if any(not isinstance(v, torch.Tensor) for v in (xv, cv, sv)) or not (xv.dtype == cv.dtype == sv.dtype):
                continue
            _replace_with_call(graph, add, torch.ops.fxc.rope.default, (x, cos, sin))
            graph.erase_node(add)
            fused += 1
        return PassResult(gm, fused > 0, {"fused": fused})


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _activation_key(x):
    """Matmuls whose activations are equal values group together: the same node, or views of
    one tensor to the same (symbolic) shape, as each decomposed linear makes its own
    ``view(x, [B*T, K])``."""
    xv = _val(x)
    if isinstance(x, Node) and x.op == "call_function" and x.target in _VIEWS and isinstance(xv, torch.Tensor):
        return ("view", x.args[0], tuple(str(d) for d in xv.shape))
    return x


@register_pass("fuse_projections")
class FuseProjectionsPass:
    requires = PassRequirements(after=("weight_layout",))  # it groups the matmuls weight_layout makes

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        graph = gm.graph
        groups: dict[tuple, list[Node]] = {}
        for node in graph.nodes:
            if (_is(node, aten.matmul.default) or _is(node, aten.mm.default)) and len(node.args) == 2 \
                    and not node.kwargs:
                w = ctx.param_of(node.args[1])
                if w is not None and w.dim() == 2:
                    groups.setdefault((node.target, _activation_key(node.args[0])), []).append(node)
        order = {n: i for i, n in enumerate(graph.nodes)}
        fused = 0
        for (target, _), mms in groups.items():
            if len(mms) < 2:
                continue
            weights = [ctx.param_of(m.args[1]) for m in mms]
            if len({(w.shape[0], w.dtype) for w in weights}) != 1:
                continue
            sizes = [int(w.shape[1]) for w in weights]
            del weights
            first = min(mms, key=order.__getitem__)
            x = first.args[0]  # every member's activation holds the same values; the first's dominates
            param = _concatenated_param(ctx, gm, [m.args[1] for m in mms], dim=1)
            with graph.inserting_before(first):
                mm = graph.call_function(target, (x, param))
                split = graph.call_function(aten.split_with_sizes.default, (mm, sizes, -1))
                parts = [graph.call_function(operator.getitem, (split, i)) for i in range(len(mms))]
            xv = _val(x)
            if xv is not None:
                mm.meta["val"] = xv.new_empty((*xv.shape[:-1], sum(sizes)))
                split.meta["val"] = [xv.new_empty((*xv.shape[:-1], s)) for s in sizes]
            for m, part in zip(mms, parts):
                part.meta["val"] = _val(m)
                m.replace_all_uses_with(part)
                w = m.args[1]
                graph.erase_node(m)
                ctx.drop_param_if_unused(gm, w)
            fused += 1
        dropped = ctx.drop_unused_params(gm)
        return PassResult(gm, fused > 0, {"fused_groups": fused, "dropped_params": dropped})


_HEAD_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _is_view(node) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in _HEAD_VIEWS


def _heads_of(node, split: Node | None):
    """``(split, index, heads_view, bias)`` if ``node`` is ``permute(view(...view([add(]getitem(split_with_sizes(X),
    i)[, bias]))), [0, 2, 1, 3])`` with ``heads_view`` the last view, to ``[B, S, H, D]``, and ``bias`` the
    second operand of the optional add (each link used once; ``split`` the one given unless None), else None."""
    if not _is(node, aten.permute.default) or list(node.args[1]) != [0, 2, 1, 3] or len(node.users) != 1:
        return None
    views, item = [], node.args[0]
    while _is_view(item) and len(item.users) == 1:
        views.append(item)
        item = item.args[0]
    bias = None
    if _is(item, aten.add.Tensor) and len(item.args) == 2 and not item.kwargs and len(item.users) == 1:
        item, bias = item.args  # a projection bias added after the split (Qwen2)
    if not views or not _is(item, operator.getitem) or len(item.users) != 1:
        return None
    sp, index = item.args
    if not _is(sp, aten.split_with_sizes.default) or (split is not None and sp is not split):
        return None
    vv = _val(views[0])
    if not isinstance(vv, torch.Tensor) or vv.dim() != 4 or len(views[0].args[1]) != 4:
        return None
    return sp, index, views[0], bias


@dataclass(frozen=True)
class _EpilogueFusion:
    """A linear op and its fused variants (``silu_mul`` None: none): where ``n`` sits in its arguments and how many
    it takes, the panel width its gate/up halves must be whole multiples of, and whether bf16 activations fuse
    (else the fused op would only run the two ops). The fused add takes the residual just before ``n``."""

    silu_mul: object | None
    add: object
    n_arg: int
    nargs: int
    panel: int = NB
    bf16_silu: bool = False


def _epilogue_fusions() -> dict:
    ops = torch.ops.fxc
    return {
        ops.linear_w4a8.default: _EpilogueFusion(ops.linear_w4a8_silu_mul.default, ops.linear_w4a8_add.default,
                                                 n_arg=5, nargs=7, panel=NB4, bf16_silu=False),
        ops.linear_w8.default: _EpilogueFusion(ops.linear_w8_silu_mul.default, ops.linear_w8_add.default,
                                               n_arg=4, nargs=6, panel=NB, bf16_silu=True),
        ops.linear_w4.default: _EpilogueFusion(ops.linear_w4_silu_mul.default, ops.linear_w4_add.default,
                                               n_arg=5, nargs=7, panel=NB, bf16_silu=True),
        # the float32 / bfloat16 linears of lower_cpu_kernels: the residual add only
        ops.linear.default: _EpilogueFusion(None, ops.linear_add.default, n_arg=3, nargs=4),
        ops.linear_by_m.default: _EpilogueFusion(None, ops.linear_by_m_add.default, n_arg=5, nargs=7),
    }


@register_pass("fuse_linear_silu_mul")
class FuseLinearSiluMulPass:
    """``fxc::silu_mul`` of the two halves of one fused gate/up ``fxc::linear_w4a8``, ``fxc::linear_w8`` or
    ``fxc::linear_w4`` (``split_with_sizes`` into ``[H, H]`` on the last dim, ``H`` a multiple of the op's panel width:
    16 / 32) becomes one ``fxc::linear_w4a8_silu_mul`` / ``fxc::linear_w8_silu_mul`` / ``fxc::linear_w4_silu_mul``:
    the product is formed in the linear's epilogue, bit for bit the two ops' result, without the ``2H``-wide
    intermediate (decode: two dispatches fewer per layer). W4A8 fuses fp32 activations only (its bf16 epilogue would
    run the two ops); W8 and W4 fuse both. Other linear ops are left as they are."""

    requires = PassRequirements(after=("quantize", "fuse_projections", "fuse_silu_mul"))  # the op, split, silu_mul

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        graph, fused, fusions = gm.graph, 0, _epilogue_fusions()
        for sm in [n for n in graph.nodes if _is(n, torch.ops.fxc.silu_mul.default)]:
            match = self._match(sm, fusions)
            if match is None:
                continue
            lin, split, gates = match
            _replace_with_call(graph, sm, fusions[lin.target].silu_mul, tuple(lin.args))
            for n in [sm, *gates, split, lin]:
                graph.erase_node(n)
            fused += 1
        return PassResult(gm, fused > 0, {"fused": fused})

    @staticmethod
    def _match(sm: Node, fusions: dict):
        gate, up = sm.args[:2] if len(sm.args) == 2 and not sm.kwargs else (None, None)
        if not (_is(gate, operator.getitem) and _is(up, operator.getitem) and gate.args[1] == 0 and up.args[1] == 1):
            return None
        split = gate.args[0]
        if up.args[0] is not split or not _is(split, aten.split_with_sizes.default) or len(split.users) != 2:
            return None
        if len(gate.users) != 1 or len(up.users) != 1:
            return None
        lin, sizes = split.args[0], split.args[1]
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        f = fusions.get(lin.target) if isinstance(lin, Node) and lin.op == "call_function" else None
        if f is None or f.silu_mul is None or len(lin.users) != 1 or lin.kwargs:
            return None
        lv = _val(lin)
        n = lin.args[f.n_arg]
        if lv is None or dim not in (-1, lv.dim() - 1):
            return None
        if lv.dtype != torch.float32 and not (f.bf16_silu and lv.dtype == torch.bfloat16):
            return None  # the fused op would only run the two ops; keep the graph as it is
        if list(sizes) != [n // 2, n // 2] or n % (2 * f.panel):  # the halves on whole panels
            return None
        return lin, split, (gate, up)


@register_pass("fuse_linear_add")
class FuseLinearAddPass:
    """``residual + lin(...)`` (``aten.add.Tensor`` of the linear, used by nothing else, and a tensor of its shape and
    dtype), ``lin`` one of ``fxc::linear_w4a8`` / ``linear_w8`` / ``linear_w4`` / ``linear`` / ``linear_by_m``, becomes
    one ``fxc::<lin>_add``: the sum formed in the linear's output loop, bit for bit the two ops (each layer's o_proj
    and down_proj with their residual adds: one dispatch and one pass over the output fewer each)."""

    requires = PassRequirements(after=("quantize", "lower_cpu_kernels"))

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        graph, fused, fusions = gm.graph, 0, _epilogue_fusions()
        for add in [n for n in graph.nodes if _is(n, aten.add.Tensor)]:
            match = self._match(add, fusions)
            if match is None:
                continue
            lin, residual = match
            f = fusions[lin.target]
            args = (*lin.args[:f.n_arg], residual, *lin.args[f.n_arg:])  # the residual goes before n
            _replace_with_call(graph, add, f.add, args)
            graph.erase_node(add)
            graph.erase_node(lin)
            fused += 1
        return PassResult(gm, fused > 0, {"fused": fused})

    @staticmethod
    def _match(add: Node, fusions: dict):
        if len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1 or set(add.kwargs) - {"alpha"}:
            return None
        for lin, other in (add.args, add.args[::-1]):
            f = fusions.get(lin.target) if isinstance(lin, Node) and lin.op == "call_function" else None
            if f is None or len(lin.users) != 1 or lin.kwargs or len(lin.args) != f.nargs \
                    or not isinstance(other, Node):
                continue
            lv, ov, av = _val(lin), _val(other), _val(add)
            if lv is None or ov is None or av is None:
                continue
            if tuple(lv.shape) == tuple(ov.shape) == tuple(av.shape) and lv.dtype == ov.dtype == av.dtype:
                return lin, other
        return None


@register_pass("fuse_qkv_attention")
class FuseQkvAttentionPass:
    """``split(qkv) → view/permute → rope → paged_attention → reshape`` becomes one ``fxc::qkv_paged_attention``."""

    requires = PassRequirements(after=("fuse_projections", "fuse_rope"))  # the split and fxc::rope it consumes

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        import fxcompiler.ops.paged_attention  # noqa: F401  (defines fxc::qkv_paged_attention)

        graph, fused = gm.graph, 0
        for pa in [n for n in graph.nodes if _is(n, torch.ops.fxc.paged_attention.default)]:
            match = self._match(pa)
            if match is None:
                continue
            out, split, ropes, cos, sin, hq, hkv, batch_seq, rest, biases = match
            bias_values = [ctx.param_of(b) if isinstance(b, Node) else None for b in biases]
            if biases[0] is not None and [tuple(v.shape) if v is not None else None for v in bias_values] != [
                    (w,) for w in split.args[1]]:
                continue  # biases must be parameters of the heads' widths (then they become one add on the projection)
            qkv = split.args[0]
            if _val(qkv).dim() == 2:  # [B*S, W] (decomposed linears): view it as [B, S, W] first
                ov, width = _val(out), _val(qkv).shape[-1]
                qkv = _call_before(graph, out, aten.view.default, (qkv, [*batch_seq, width]),
                                   ov.new_empty((ov.shape[0], ov.shape[1], width)))
            if biases[0] is not None:
                bias = _concatenated_param(ctx, gm, biases, dim=0)
                qkv = _call_before(graph, out, aten.add.Tensor, (qkv, bias), _val(qkv))
            _replace_with_call(graph, out, torch.ops.fxc.qkv_paged_attention.default,
                               (qkv, cos, sin, *pa.args[3:9], hq, hkv, *rest))
            for n in [out, pa, *ropes, *(n for a in pa.args[:3] for n in self._chain(a))]:
                graph.erase_node(n)
            if not split.users:
                graph.erase_node(split)
            for b in biases:
                if b is not None:
                    ctx.drop_param_if_unused(gm, b)
            fused += 1
        return PassResult(gm, fused > 0, {"fused": fused})

    @staticmethod
    def _chain(node: Node) -> list[Node]:
        """The permute, view, bias add and getitem nodes that feed one attention input (past its rope), users
        first."""
        chain = []
        if _is(node, torch.ops.fxc.rope.default):
            node = node.args[0]  # the rope node itself is erased with the ropes
        while not _is(node, aten.split_with_sizes.default):
            chain.append(node)
            node = node.args[0]
        return chain

    @staticmethod
    def _match(pa: Node):
        if pa.kwargs or len(pa.args) < 10 or len(pa.args) > 12 or len(pa.users) != 1:  # > 12: sinks (no fused form)
            return None
        out = next(iter(pa.users))
        if not _is_view(out):
            return None
        q, k, v = pa.args[:3]
        ropes, cos, sin = [], None, None
        if _is(q, torch.ops.fxc.rope.default) or _is(k, torch.ops.fxc.rope.default):
            if not (_is(q, torch.ops.fxc.rope.default) and _is(k, torch.ops.fxc.rope.default)) \
                    or q.args[1:] != k.args[1:] or len(q.users) != 1 or len(k.users) != 1:
                return None
            ropes, (cos, sin) = [q, k], q.args[1:]
            q, k = q.args[0], k.args[0]
        q_heads = _heads_of(q, None)
        if q_heads is None:
            return None
        split = q_heads[0]
        k_heads, v_heads = _heads_of(k, split), _heads_of(v, split)
        if k_heads is None or v_heads is None or [q_heads[1], k_heads[1], v_heads[1]] != [0, 1, 2]:
            return None
        # the head views are [B, S, H, D]
        (_, _, hq, d), (_, _, hkv, _), (_, _, hv, _) = (_val(h[2]).shape for h in (q_heads, k_heads, v_heads))
        biases = [h[3] for h in (q_heads, k_heads, v_heads)]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            return None
        xv, ov = _val(split.args[0]), _val(out)
        if not isinstance(xv, torch.Tensor) or xv.dim() not in (2, 3) or not isinstance(ov, torch.Tensor) \
                or ov.dim() != 3 or hv != hkv:
            return None
        split_dim = split.args[2] if len(split.args) > 2 else 0
        if split_dim not in (-1, xv.dim() - 1) or list(split.args[1]) != [hq * d, hkv * d, hkv * d] \
                or len(split.users) != 3 or ov.shape[-1] != hq * d:
            return None
        batch_seq = list(q_heads[2].args[1][:2])  # the B, S sizes (ints or SymInt nodes) of the head views
        return out, split, ropes, cos, sin, int(hq), int(hkv), batch_seq, tuple(pa.args[9:]), biases
