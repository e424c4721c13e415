"""``cse``: common-subexpression elimination over pure ``call_function`` nodes.

Two nodes that call the same pure op on the same arguments compute the same value; the
later one is replaced by the earlier one. Captured graphs have few such pairs (a handful of
``sym_size`` calls), but ``decompose(model_rewrite=True)`` gives each linear its own
``sym_size → mul → view`` of the activation, and user passes that build subgraphs per site
leave more; merging them lets ``fuse_projections`` see one activation and saves dispatches.

The rule (walked in graph order, i.e. execution order):

* Candidates are ``call_function`` nodes whose target is an ``OpOverload`` with a
  non-mutable schema, not in-place (``op_``), not tagged ``nondeterministic_seeded``
  (random ops), not an assertion/print and not impure by ``Node.is_impure``; or a function
  of Python's ``operator`` module (SymInt arithmetic, ``getitem``). Never: mutating ops
  (``fxc::paged_attention`` writes the KV caches), ``torch.ops.higher_order.*``,
  ``call_module``/``call_method`` nodes, placeholders and outputs.
* The key is ``(target, args, kwargs)`` with earlier replacements applied and constants
  typed (``1``, ``1.0`` and ``True`` differ; ``-0.0`` and ``0.0`` differ), plus, for every
  tensor input, the number of mutations its storage has seen so far. A mutation is a
  write to an argument whose schema alias is ``!`` (storage = the input behind any chain of
  view ops), and an opaque call (non-``OpOverload``, non-``operator``, higher-order op)
  counts as a write to every tensor it receives. So a read of a KV cache before
  ``paged_attention`` never merges with the same read after it.
* A node whose own storage is ever written (a buffer later filled in place, or a view
  of a cache) is never merged, in either direction.

Requires: nothing beyond a well-formed graph (``meta["val"]`` is not needed).
Ensures: the same function; the signature is unchanged; ``info["eliminated"]`` nodes fewer.
"""
from __future__ import annotations

import math
import operator
from collections import Counter

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node

from fxcompiler.pass_manager import CompileContext, PassResult, register_pass

_OPERATOR_FUNCTIONS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.neg, operator.pos, operator.abs, operator.invert, operator.not_, operator.and_, operator.or_,
    operator.xor, operator.lshift, operator.rshift, operator.eq, operator.ne, operator.lt, operator.le,
    operator.gt, operator.ge, operator.getitem,
})


def _is_op(target) -> bool:
    return isinstance(target, torch._ops.OpOverload)


def is_pure(node: Node) -> bool:
    """May ``node`` be merged with an identical call? (See the module docstring.)"""
    if node.op != "call_function":
        return False
    target = node.target
    if target in _OPERATOR_FUNCTIONS:
        return True
    if not _is_op(target):
        return False  # higher-order ops, Python callables: unknown effects
    schema = target._schema
    name = schema.name.split("::")[-1]
    if schema.is_mutable or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    if name.endswith("_") or name.startswith("_assert") or name in ("_print", "print"):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return not node.is_impure()


def _view_source(node: Node) -> Node | None:
    """The input whose storage ``node``'s result aliases (view ops, getitem of a split), else None."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        src = node.args[0]
        return src if isinstance(src, Node) else None
    if not _is_op(node.target):
        return None
    schema = node.target._schema
    sets = set()
    for r in schema.returns:
        if r.alias_info is not None and not r.alias_info.is_write:
            sets |= set(r.alias_info.before_set)
    if not sets:
        return None
    for arg, value in zip(schema.arguments, node.args):
        if arg.alias_info is not None and set(arg.alias_info.before_set) & sets and isinstance(value, Node):
            return value
    return None


def _written_inputs(node: Node) -> list[Node]:
    """Tensor inputs ``node`` may write: ``!`` arguments, or everything for an opaque call."""
    if node.op in ("placeholder", "output", "get_attr"):
        return []
    if node.op == "call_function" and (node.target in _OPERATOR_FUNCTIONS):
        return []
    if node.op == "call_function" and _is_op(node.target):
        schema = node.target._schema
        if not schema.is_mutable:
            return []
        written = []
        bound = list(zip(schema.arguments, node.args))
        bound += [(a, node.kwargs[a.name]) for a in schema.arguments if a.name in node.kwargs]
        for arg, value in bound:
            if arg.alias_info is not None and arg.alias_info.is_write:
                written += [v for v in pytree.tree_leaves(value) if isinstance(v, Node)]
        return written
    return [v for v in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(v, Node)]


def _constant_key(value):
    if isinstance(value, float):
        return ("float", repr(value)) if not math.isnan(value) else ("float", "nan")
    if isinstance(value, (bool, int, str, type(None))):
        return (type(value).__name__, value)
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(value).__name__, str(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_constant_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _constant_key(v)) for k, v in value.items())))
    if isinstance(value, Node):
        return ("node", value)
    if isinstance(value, slice):
        return ("slice", _constant_key(value.start), _constant_key(value.stop), _constant_key(value.step))
    raise TypeError  # e.g. a tensor constant: not keyed, the node is not merged


@register_pass("cse")
class CommonSubexpressionEliminationPass:
    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        graph = gm.graph
        nodes = list(graph.nodes)
        root: dict[Node, Node] = {}
        for n in nodes:
            src = _view_source(n)
            root[n] = root.get(src, src) if src is not None else n
        written_roots = {root.get(w, w) for n in nodes for w in _written_inputs(n)}

        version: Counter = Counter()
        seen: dict[tuple, Node] = {}
        eliminated = 0
        by_op: Counter = Counter()
        for node in nodes:
            if is_pure(node) and root[node] not in written_roots:
                inputs = [v for v in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(v, Node)]
                try:
                    key = (node.target, _constant_key(tuple(node.args)), _constant_key(dict(node.kwargs)),
                           tuple(version[root.get(v, v)] for v in inputs))
                except TypeError:
                    key = None
                if key is not None:
                    prior = seen.get(key)
                    if prior is None:
                        seen[key] = node
                    else:
                        node.replace_all_uses_with(prior)
                        graph.erase_node(node)
                        eliminated += 1
                        by_op[str(node.target)] += 1
                        continue
            for w in _written_inputs(node):
                version[root.get(w, w)] += 1
        return PassResult(gm, eliminated > 0, {"eliminated": eliminated, "by_op": dict(by_op)})
