"""``decompose``: rewrite composite ops of the captured graph into core ATen (a project table).

The captured graph is torch.export's training IR: CompositeImplicitAutograd ops such as
``layer_norm``, ``dropout`` and ``to`` survive as single nodes, and a few non-core ops
(``transpose``, ``split``) stay as they were written. Backends that do not run the graph
eagerly (the ONNX ``dfg`` and AOTInductor ``edf`` kinds) want core ATen. ``run_decompositions``
cannot be used: it functionalises the whole program, which would turn the in-place KV-cache
writes of ``fxc::paged_attention`` into copies. So the pass decomposes *per node*: for each
``call_function`` node whose op has a table entry, it traces the entry with ``make_fx``
(symbolic mode) on fake copies of the node's ``meta["val"]`` inputs and splices the traced
subgraph in place of the node. The copies live in a fresh fake mode and shape environment,
one fresh symbol per export symbol (ranges and unifications of equal dims kept): copies of
a capture share one environment, and a pass that compares a symbolic size with a number can
specialise a dim there; tracing in it would bake that number into the decomposition. Sizes
in the subgraph are ``sym_size`` calls on its inputs, so it is generic in every dynamic dim;
the new nodes' ``meta["val"]`` are then recomputed in the graph's own fake mode. Layers
repeat, so a trace is reused for nodes with the same op, arguments and input metadata. Nothing else is touched: placeholders (and their names), ``fxc::*`` ops and every
mutating op are never decomposed. In-place ops that a decomposition emits on a fresh
intermediate it owns (``mean(...).add_(eps)``) are made out-of-place.

Default table (``DEFAULT_TABLE``, built on first use; the ops' own CompositeImplicitAutograd kernels or
``torch._decomp``'s core-ATen entries, except where "project" is said):

=================================================  ==========================================
``dropout``                                        identity when ``train=False`` (project;
                                                   the CIA kernel emits a copy), else
                                                   ``native_dropout``
``to.dtype`` ``to.device`` ``to.dtype_layout``      ``_to_copy`` (nothing when no conversion
``to.other`` ``type_as``                           is needed)
``contiguous``                                     ``clone`` (nothing when contiguous)
``layer_norm``                                     ``native_layer_norm`` + ``getitem``
``rms_norm`` (aten)                                ``pow → mean → add eps → rsqrt → mul → mul
                                                   weight`` (upcast/downcast for 16-bit)
``transpose.int`` ``t``                            ``permute``
``split.Tensor`` ``chunk``                         ``split_with_sizes`` + ``getitem``
``matmul``                                         ``mm`` / ``bmm`` / ``view`` / ``expand``
``softmax.int`` ``log_softmax.int``                ``_softmax`` / ``_log_softmax``
``expand_as`` ``view_as``                          ``expand`` / ``view``
=================================================  ==========================================

Kept on purpose: ``linear`` (``weight_layout`` and ``fuse_projections`` rewrite it),
``silu`` (``fuse_silu_mul`` matches it; every backend has it), ``reshape`` /
``flatten`` (their decomposition picks ``view`` or ``clone + _unsafe_view`` from the fake
strides, and the ``fxc::*`` fake kernels do not promise the strides of their device
kernels), and every ``fxc::*`` op.

``model_rewrite=True`` (or ``ctx.options["do_decompositions_for_model_rewrite"]``) adds
(``MODEL_REWRITE_TABLE``) ``linear`` → ``permute(w, [1, 0])`` + ``mm`` / ``addmm`` (with
``view`` / ``_unsafe_view`` around it for 3-D activations), ``native_layer_norm`` →
``var_mean → sub → rsqrt → mul → mul weight → add bias``, and ``fxc::rms_norm`` → its ATen
reference, so that a later sharding pass can address the pieces. ``weight_layout`` and
``fuse_projections`` recognise the decomposed linears, so the default pipeline after it
still produces pre-transposed ``[K, N]`` matmuls and fused projections.

Requires: an ATen graph from :mod:`fxcompiler.capture` with ``meta["val"]`` on nodes (fake
tensors of one fake mode with a shape environment).
Ensures: the same function (the decompositions are the ops' own definitions; fp results may
differ by rounding for ``layer_norm``); placeholders, the signature and the ``fxc::*`` ops
are unchanged; every new node has ``meta["val"]``; the graph's shape environment is not
touched by the traces. A node whose decomposition would guard on (specialise) a symbolic
size, or that fails to trace, is left as it was and counted in ``info["skipped"]``.
"""
from __future__ import annotations

import functools
import logging
import operator
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

import fxcompiler.ops.fused  # noqa: F401  (defines fxc::rms_norm)
from fxcompiler.pass_manager import CompileContext, PassResult, register_pass

log = logging.getLogger("fxcompiler.passes.decompose")

aten = torch.ops.aten

OPTION = "do_decompositions_for_model_rewrite"


def _cia(op: torch._ops.OpOverload) -> Callable:
    """The op's CompositeImplicitAutograd kernel as a decomposition."""
    return lambda *args, **kwargs: op.decompose(*args, **kwargs)


def _core(op: torch._ops.OpOverload) -> Callable:
    """torch._decomp's core-ATen entry for ``op``."""
    from torch._decomp import decomposition_table

    return decomposition_table[op]


def _dropout(x, p: float, train: bool | None):
    if not train or p == 0:
        return x
    return aten.native_dropout.default(x, p, train)[0]


def _rms_norm(x, normalized_shape, weight=None, eps=None):
    """aten.rms_norm as primitives; 16-bit inputs are normalised in fp32 like the ATen kernel."""
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    acc = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    if eps is None:
        eps = torch.finfo(acc.dtype).eps
    out = acc * torch.rsqrt(acc.pow(2).mean(dims, keepdim=True) + eps)
    if weight is not None:
        out = out * weight
    return out.to(x.dtype)


def _fxc_rms_norm(x, weight, eps: float):
    """fxc::rms_norm's ATen reference, op for op (bit-identical)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _native_layer_norm(*args, **kwargs):
    from torch._decomp import decomposition_table

    return decomposition_table[aten.native_layer_norm.default](*args, **kwargs)


def _default_table() -> dict[torch._ops.OpOverload, Callable]:
    table: dict[torch._ops.OpOverload, Callable] = {aten.dropout.default: _dropout, aten.rms_norm.default: _rms_norm}
    for op in (aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.to.other, aten.type_as.default,
               aten.contiguous.default, aten.layer_norm.default, aten.chunk.default, aten.matmul.default,
               aten.softmax.int, aten.log_softmax.int, aten.expand_as.default, aten.view_as.default):
        table[op] = _cia(op)
    for op in (aten.transpose.int, aten.t.default, aten.split.Tensor):
        table[op] = _core(op)
    return table


def _model_rewrite_table() -> dict[torch._ops.OpOverload, Callable]:
    return {aten.linear.default: _cia(aten.linear.default),
            aten.native_layer_norm.default: _native_layer_norm,
            torch.ops.fxc.rms_norm.default: _fxc_rms_norm}


@functools.cache
def default_table() -> dict[torch._ops.OpOverload, Callable]:
    """The default table (built on first use: ``torch._decomp`` costs ~0.6 s to load)."""
    return _default_table()


@functools.cache
def model_rewrite_table() -> dict[torch._ops.OpOverload, Callable]:
    """What ``model_rewrite=True`` adds to the table."""
    return _model_rewrite_table()


def __getattr__(name: str):  # PEP 562: DEFAULT_TABLE / MODEL_REWRITE_TABLE, built lazily
    if name == "DEFAULT_TABLE":
        return default_table()
    if name == "MODEL_REWRITE_TABLE":
        return model_rewrite_table()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _never_decompose(op) -> bool:
    """Mutating ops (the KV-cache writes) and the attention op stay whole whatever the table says."""
    return (not isinstance(op, torch._ops.OpOverload) or op._schema.is_mutable
            or op is getattr(torch.ops.fxc, "paged_attention", None))


class _Untraceable(Exception):
    pass


@register_pass("decompose")
class DecomposePass:
    """Per-node decomposition to core ATen; see the module docstring for the table."""

    def __init__(self, model_rewrite: bool | None = None,
                 table: Mapping[torch._ops.OpOverload, Callable] | None = None, max_rounds: int = 8):
        self.model_rewrite = model_rewrite
        self.table = dict(table) if table is not None else None
        self.max_rounds = max_rounds

    def table_for(self, ctx: CompileContext | None) -> dict:
        rewrite = self.model_rewrite
        if rewrite is None:
            rewrite = bool((ctx.options if ctx is not None else {}).get(OPTION, False))
        table = dict(default_table() if self.table is None else self.table)
        if rewrite:
            table.update(model_rewrite_table())
        return {op: fn for op, fn in table.items() if not _never_decompose(op)}

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        table = self.table_for(ctx)
        graph = gm.graph
        done: Counter = Counter()
        skipped: Counter = Counter()
        failed: set[Node] = set()
        traces: dict = {}  # signature -> traced subgraph (or the reason it could not be traced)
        for _ in range(self.max_rounds):  # a decomposition may emit ops that have entries themselves
            todo = [n for n in graph.nodes if n.op == "call_function" and n.target in table and n not in failed]
            if not todo:
                break
            for node in todo:
                try:
                    _decompose_node(gm, node, table[node.target], table, traces)
                    done[str(node.target)] += 1
                except _Untraceable as exc:
                    log.debug("decompose: kept %s (%s)", node.format_node(), exc)
                    skipped[str(node.target)] += 1
                    failed.add(node)
        n = sum(done.values())
        rewrite = aten.linear.default in table
        return PassResult(gm, n > 0, {"decomposed": n, "by_op": dict(done), "skipped": sum(skipped.values()),
                                      "skipped_ops": dict(skipped), "model_rewrite": rewrite})


def _val(x):
    return x.meta.get("val") if isinstance(x, Node) else x


def _unspecialised(expr, env):
    """``expr`` with the environment's symbol-to-symbol replacements (the export's unifications of
    equal dims) applied, but not its symbol-to-number ones: a pass that compared a symbolic size
    with a number (``shape == other.shape``) may have specialised the shared environment."""
    if not hasattr(expr, "free_symbols"):
        return expr
    reps = {k: v for k, v in env.replacements.items() if not v.is_number}
    for _ in range(16):
        new = expr.xreplace(reps)
        if new == expr:
            break
        expr = new
    return expr


def _hints(env) -> dict:
    hints = getattr(env, "backed_var_to_val", None)  # torch >= 2.13 (var_to_val is deprecated)
    return hints if hints is not None else env.var_to_val


def _hint(expr, env) -> int:
    hints = _hints(env)
    return int(expr.xreplace({sym: hints[sym] for sym in expr.free_symbols}))


class _FreshWorld:
    """A new fake mode and shape environment for tracing one decomposition: the node's inputs are
    re-created there with one fresh symbol per (unspecialised) export symbol, so nothing the
    graph's own environment has learned since export (or learns during the trace) leaks into the
    decomposition, and any guard the trace needs shows up in a clean environment."""

    def __init__(self, env0):
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        self.env0 = env0
        self.env = ShapeEnv()
        self.mode = FakeTensorMode(shape_env=self.env)
        self.symbols: dict = {}

    def _symbol(self, sym):
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic

        if sym not in self.symbols:
            from torch.utils._sympy.numbers import int_oo

            hints = _hints(self.env0)
            if sym not in hints:
                raise _Untraceable(f"symbol {sym} has no hint")
            fresh = self.env.create_symbol(
                int(hints[sym]), ConstantSource(f"fxc_decompose_{len(self.symbols)}"),
                dynamic_dim=DimDynamic.DYNAMIC, do_not_specialize_zero_one=True)
            # the export's range (sizes >= 2, the dims' maxima), unless something narrowed it to one value
            vr = self.env0.var_to_range.get(sym)
            lo, hi = (vr.lower, vr.upper) if vr is not None and vr.lower != vr.upper else (2, int_oo)
            self.env.constrain_symbol_range(fresh, lo, hi)
            self.symbols[sym] = fresh
        return self.symbols[sym]

    def symint(self, x):
        if not isinstance(x, torch.SymInt):
            return x
        expr = _unspecialised(x.node._expr, self.env0)
        if not expr.free_symbols:
            return int(expr)
        fresh = expr.xreplace({sym: self._symbol(sym) for sym in expr.free_symbols})
        return self.env.create_symintnode(fresh, hint=_hint(expr, self.env0))

    def value(self, v):
        if isinstance(v, torch.Tensor):
            with self.mode:
                return torch.empty_strided([self.symint(d) for d in v.shape], [self.symint(d) for d in v.stride()],
                                           dtype=v.dtype, device=v.device)
        if isinstance(v, torch.SymInt):
            return self.symint(v)
        if isinstance(v, (torch.SymFloat, torch.SymBool)):
            raise _Untraceable("symbolic float/bool input")
        return v


def _trace(node: Node, fn: Callable, table: Mapping) -> GraphModule:
    """``fn(*node.args, **node.kwargs)`` traced (make_fx, symbolic) on fresh fake copies of the
    node's inputs; the subgraph has one placeholder per Node argument, in argument order."""
    from torch.fx.experimental.proxy_tensor import make_fx

    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, Node)]
    vals = [_val(flat[i]) for i in positions]
    if any(v is None for v in vals):
        raise _Untraceable("an input has no meta['val']")
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None or mode.shape_env is None:
        raise _Untraceable("no fake mode with a shape environment on the inputs")
    world = _FreshWorld(mode.shape_env)
    fresh = [world.value(v) for v in vals]

    def call(*xs):
        leaves = list(flat)
        for i, x in zip(positions, xs):
            leaves[i] = x
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return fn(*args, **kwargs)

    try:
        with world.mode:
            sub = make_fx(call, decomposition_table=dict(table), tracing_mode="symbolic")(*fresh)
    except Exception as exc:
        raise _Untraceable(f"trace failed: {exc}") from exc
    if world.env.guards or world.env.replacements:
        raise _Untraceable("the decomposition guards on a symbolic size")
    return sub


def _refresh_values(nodes: list[Node], mode) -> None:
    """Recompute ``meta["val"]`` of spliced nodes in the graph's own fake mode (the trace's values
    live in the fresh one)."""
    for n in nodes:
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
        with mode:
            n.meta["val"] = n.target(*args, **kwargs)


def _returns_fresh(node: Node) -> bool:
    """True if ``node`` returns a new tensor (not a view/alias of an input)."""
    t = node.target
    if not isinstance(t, torch._ops.OpOverload) or t._schema.is_mutable:
        return False
    return all(r.alias_info is None for r in t._schema.returns)


def _out_of_place(sub: GraphModule) -> None:
    """``y = x.op_(...)`` → ``y = op(x, ...)`` where ``x`` is a fresh intermediate of the
    subgraph read by nothing else (so nobody can observe the difference)."""
    for n in list(sub.graph.nodes):
        t = n.target
        if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
            continue
        name = t._schema.name.split("::")[-1]
        if not name.endswith("_") or name.endswith("__") or not n.args:
            continue
        x = n.args[0]
        if not isinstance(x, Node) or x.op != "call_function" or not _returns_fresh(x) or len(x.users) != 1:
            continue
        packet = getattr(getattr(torch.ops, t.namespace), name[:-1], None)
        functional = getattr(packet, t._overloadname, None) if packet is not None else None
        if functional is None or functional._schema.is_mutable:
            continue
        with sub.graph.inserting_before(n):
            new = sub.graph.call_function(functional, n.args, n.kwargs)
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        sub.graph.erase_node(n)


def _dim_key(d) -> str:
    if isinstance(d, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(_unspecialised(d.node._expr, d.node.shape_env))
    return str(d)


def _signature(node: Node):
    """What a decomposition can depend on: the op, the argument structure and constants, and the
    inputs' (symbolic) shapes, strides, dtypes and devices. Layers repeat, so most nodes share
    a signature with an earlier one and reuse its trace. None: not cacheable."""
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    parts = []
    first_pos: dict[Node, int] = {}
    for i, a in enumerate(flat):
        if isinstance(a, Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                part = ("T", tuple(_dim_key(d) for d in v.shape), tuple(_dim_key(d) for d in v.stride()),
                        _dim_key(v.storage_offset()), v.dtype, str(v.device), v.layout)
            elif isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                part = ("S", type(v).__name__, _dim_key(v))
            else:
                return None
            parts.append((part, first_pos.setdefault(a, i)))
        elif isinstance(a, (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout,
                            torch.memory_format)):
            parts.append(("C", type(a).__name__, repr(a)))
        else:
            return None
    return node.target, str(spec), tuple(parts)


def _prepare(node: Node, fn: Callable, table: Mapping) -> GraphModule:
    sub = _trace(node, fn, table)
    _out_of_place(sub)
    sub.graph.eliminate_dead_code()
    return sub


def _decompose_node(gm: GraphModule, node: Node, fn: Callable, table: Mapping, traces: dict) -> None:
    graph = gm.graph
    sig = _signature(node)
    sub = traces.get(sig) if sig is not None else None
    if sub is None:
        try:
            sub = _prepare(node, fn, table)
        except _Untraceable as exc:
            sub = exc
        if sig is not None:
            traces[sig] = sub
    if isinstance(sub, _Untraceable):
        raise sub
    flat = pytree.tree_leaves((node.args, node.kwargs))
    inputs = [a for a in flat if isinstance(a, Node)]
    out = next(n for n in sub.graph.nodes if n.op == "output").args[0]
    val = node.meta.get("val")
    multi = isinstance(val, (tuple, list))
    if multi and not all(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
                         for u in node.users):
        raise _Untraceable("a user of the tuple result is not getitem")
    leaves = pytree.tree_leaves(out)
    if not all(isinstance(a, Node) for a in leaves) or (multi and not isinstance(out, (tuple, list))) \
            or (not multi and not isinstance(out, Node)):
        raise _Untraceable("the decomposition does not return tensor nodes like the op")
    env: dict[Node, Any] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise _Untraceable("placeholder count mismatch")
    env.update(zip(placeholders, inputs))
    if any(n.op not in ("placeholder", "output", "call_function") for n in sub.graph.nodes):
        raise _Untraceable("the decomposition has constants or modules")
    mode = detect_fake_mode([a.meta.get("val") for a in inputs])
    copy_meta = {k: node.meta[k] for k in ("stack_trace", "nn_module_stack", "source_fn_stack") if k in node.meta}
    added: list[Node] = []
    with graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "call_function":
                new = graph.node_copy(n, lambda a: env[a])
                for k, v in copy_meta.items():
                    new.meta.setdefault(k, v)
                env[n] = new
                added.append(new)
    try:
        _refresh_values(added, mode)
    except Exception as exc:
        for n in reversed(added):
            graph.erase_node(n)
        raise _Untraceable(f"fake propagation of the decomposition failed: {exc}") from exc
    result = pytree.tree_map(lambda a: env[a] if isinstance(a, Node) else a, out)
    if multi:
        for user in list(node.users):
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)
