"""A declarative pattern matcher on the compiler's ATen IR (in the spirit of Inductor's
``register_replacement`` / ``PatternMatcherPass``).

A pattern and its replacement are plain Python functions over tensors; both are traced to ATen
with ``make_fx`` on example inputs, so they read like the model code they match::

    from fxcompiler.pattern_matcher import PatternMatcherPass, Scalar

    def search(x, w, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def replace(x, w, eps):
        return torch.ops.fxc.rms_norm(x, w, eps)

    fuse = PatternMatcherPass("my_rms_norm")
    fuse.register_replacement(search, replace, [torch.empty(2, 8), torch.empty(8), Scalar("eps")],
                              extra_check=lambda m: m.val("w").dtype == m.val("x").dtype)

Matching rules:

* Tensor inputs of the pattern match any node (any shape, any dtype); an input used twice
  must be the same node both times.
* Every other literal of the traced pattern must be equal in the graph, except the
  wildcards: :class:`Scalar` (an int/float argument, bound by name; ``example`` is the value
  traced with and the literal that becomes the wildcard, so pick one the pattern does not
  otherwise use) and :class:`Dtype` (a dtype argument, e.g. of ``x.to(dtype)``).
* ``aten.add.Tensor`` / ``aten.mul.Tensor`` match with their operands in either order.
* The nodes of a match other than its output must have no users outside it (they are erased).
* ``extra_check(match) -> bool`` may reject a match (it reads ``match[name]`` / ``match.val(name)``).

Replacements are inserted before the matched output node, take over its users, and get
``meta["val"]`` by running each new node on its inputs' fake values (:func:`refresh_meta_val`),
so later passes and the verifier see true shapes. The pass's ``info`` counts matches per
pattern (``count_key``, default ``"matched"``) and, when nothing matched, says what blocked the
closest candidate (``"blocked"``; with ``must_fire=True`` the pass manager warns with it).

Requires: ``meta["val"]`` is not needed for matching, only by extra checks that read it.
Ensures: each replacement computes what its pattern computed (the author's responsibility;
test it with :func:`fxcompiler.testing.assert_pass_preserves_semantics`).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.fx import GraphModule, Node

from .pass_manager import CompileContext, PassRequirements, PassResult, refresh_meta_val

__all__ = ["Scalar", "Dtype", "Match", "Pattern", "PatternMatcherPass", "replace_pattern", "refresh_meta_val"]

aten = torch.ops.aten
COMMUTATIVE = {aten.add.Tensor, aten.mul.Tensor}
_FLOAT_SENTINELS = iter(0.000123456789 + i * 1e-10 for i in range(10 ** 6))


@dataclass(frozen=True)
class Scalar:
    """A scalar argument of a pattern that matches any value, bound under ``name``."""

    name: str
    example: int | float | None = None


@dataclass(frozen=True)
class Dtype:
    """A dtype argument of a pattern that matches any dtype, bound under ``name``; ``example``
    (default ``torch.float16``) is the dtype traced with."""

    name: str
    example: torch.dtype = torch.float16


class _Wild:
    """A literal of the traced pattern that matches anything (bound under ``name``)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


@dataclass
class Match:
    """One match: ``match[name]`` is what the pattern input ``name`` bound to (a graph node or a
    literal), ``match.val(name)`` its ``meta["val"]``; ``nodes`` maps the traced pattern's node names
    (``pow_1``, ``mul``, ...) to the matched graph nodes; ``anchor`` is the matched output node."""

    anchor: Node
    bindings: dict[str, Any] = field(default_factory=dict)
    nodes: dict[str, Node] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]

    def val(self, name: str):
        """``meta["val"]`` of the node bound to ``name`` (None for literals and nodes without one)."""
        v = self.bindings[name]
        return v.meta.get("val") if isinstance(v, Node) else None


class _NoMatch(Exception):
    def __init__(self, reason: str, depth: int):
        super().__init__(reason)
        self.depth = depth


class Pattern:
    """A traced search function and its traced replacement (see the module docstring)."""

    def __init__(self, search: Callable, replace: Callable, example_inputs: Sequence[Any],
                 extra_check: Callable[[Match], bool] | None = None, name: str | None = None):
        self.name = name or getattr(search, "__name__", "pattern")
        params = list(inspect.signature(search).parameters)
        if len(params) != len(example_inputs):
            raise ValueError(f"pattern {self.name!r}: {len(params)} parameters but {len(example_inputs)} example inputs")
        self.input_names = params
        self.extra_check = extra_check
        args, self.wild_literals = [], {}  # traced literal -> wildcard
        for pname, ex in zip(params, example_inputs):
            if isinstance(ex, Scalar):
                value = ex.example if ex.example is not None else next(_FLOAT_SENTINELS)
                self.wild_literals[(type(value), value)] = _Wild(ex.name)
                args.append(value)
            elif isinstance(ex, Dtype):
                self.wild_literals[(torch.dtype, ex.example)] = _Wild(ex.name)
                args.append(ex.example)
            elif isinstance(ex, torch.Tensor):
                args.append(torch.zeros_like(ex, device="cpu") if ex.device.type == "meta" else ex)
            else:
                raise ValueError(f"pattern {self.name!r}: example input {pname!r} must be a tensor, Scalar or Dtype, "
                                 f"got {type(ex).__name__}")
        self.search_graph = _trace(search, args).graph
        self.replace_graph = _trace(replace, args).graph
        self._wild_of_name = {w.name: w for w in self.wild_literals.values()}
        self._input_of_placeholder = dict(zip((n for n in self.search_graph.nodes if n.op == "placeholder"), params))
        out = next(n for n in self.search_graph.nodes if n.op == "output")
        anchor = out.args[0]
        if isinstance(anchor, (tuple, list)):
            if len(anchor) != 1:
                raise ValueError(f"pattern {self.name!r}: a pattern returns one tensor")
            anchor = anchor[0]
        if not isinstance(anchor, Node) or anchor.op != "call_function":
            raise ValueError(f"pattern {self.name!r}: its output must be computed by an operator")
        self.anchor = anchor
        self.size = sum(n.op == "call_function" for n in self.search_graph.nodes)

    # -- matching ---------------------------------------------------------------------------------
    def match(self, node: Node) -> Match:
        """The match rooted at ``node`` (its output), or :class:`_NoMatch` saying why not."""
        state = _State(Match(node), {}, {})
        self._match_node(self.anchor, node, state)
        m = state.match
        inside = set(state.nodes.values())
        for pn, gn in state.nodes.items():
            if gn is not node:
                outside = [u.name for u in gn.users if u not in inside]
                if outside:
                    raise _NoMatch(f"node {gn.name!r} (pattern {pn.name!r}) is also used outside the pattern by "
                                   f"{outside[:3]}", self.size)
        for pn, name in self._input_of_placeholder.items():
            if pn in state.bound:
                m.bindings[name] = state.bound[pn]
        m.bindings.update({w.name: v for w, v in state.wild.items()})
        m.nodes = {pn.name: gn for pn, gn in state.nodes.items()}
        if self.extra_check is not None and not self.extra_check(m):
            raise _NoMatch(f"extra check {getattr(self.extra_check, '__name__', 'extra_check')!r} rejected the match "
                           f"at {node.name!r}", self.size + 1)
        return m

    def _match_node(self, pn: Node, gn: Any, st: "_State") -> None:
        if pn.op == "placeholder":
            if not isinstance(gn, Node):
                raise _NoMatch(f"pattern input {self._input_of_placeholder.get(pn, pn.name)!r} expects a node, "
                               f"got the literal {gn!r}", len(st.nodes))
            if st.bound.setdefault(pn, gn) is not gn:
                raise _NoMatch(f"pattern input {self._input_of_placeholder.get(pn, pn.name)!r} would bind both "
                               f"{st.bound[pn].name!r} and {gn.name!r}", len(st.nodes))
            return
        if not isinstance(gn, Node) or gn.op != "call_function" or gn.target != pn.target:
            what = f"{gn.name!r} is {gn.target if gn.op == 'call_function' else gn.op}" if isinstance(gn, Node) \
                else f"the literal {gn!r}"
            raise _NoMatch(f"{what} where the pattern has {pn.target} ({pn.name!r})", len(st.nodes))
        if pn in st.nodes:
            if st.nodes[pn] is not gn:
                raise _NoMatch(f"pattern node {pn.name!r} would match both {st.nodes[pn].name!r} and {gn.name!r}",
                               len(st.nodes))
            return
        if gn in st.nodes.values():
            raise _NoMatch(f"node {gn.name!r} would match two pattern nodes", len(st.nodes))
        if set(pn.kwargs) != set(gn.kwargs) or len(pn.args) != len(gn.args):
            raise _NoMatch(f"{gn.name!r} ({gn.format_node()}) has other arguments than the pattern's {pn.name!r}",
                           len(st.nodes))
        st.nodes[pn] = gn
        orders = [gn.args]
        if pn.target in COMMUTATIVE and len(gn.args) == 2 and not gn.kwargs:
            orders.append((gn.args[1], gn.args[0]))
        failure = None
        for args in orders:
            saved = st.copy()
            try:
                for pa, ga in zip(pn.args, args):
                    self._match_arg(pa, ga, st)
                for key, pa in pn.kwargs.items():
                    self._match_arg(pa, gn.kwargs[key], st)
                return
            except _NoMatch as exc:
                st.restore(saved)
                if failure is None or exc.depth > failure.depth:
                    failure = exc
        raise failure

    def _match_arg(self, pa: Any, ga: Any, st: "_State") -> None:
        if isinstance(pa, Node):
            self._match_node(pa, ga, st)
            return
        wild = self._wildcard(pa)
        if wild is not None:
            if isinstance(ga, Node) and (ga.op != "call_function" or isinstance(ga.meta.get("val"), torch.Tensor)
                                         or "val" not in ga.meta):
                raise _NoMatch(f"wildcard {wild.name!r} expects a scalar, got node {ga.name!r}", len(st.nodes))
            if wild in st.wild and st.wild[wild] != ga:
                raise _NoMatch(f"wildcard {wild.name!r} would bind both {st.wild[wild]!r} and {ga!r}", len(st.nodes))
            st.wild[wild] = ga
            return
        if isinstance(pa, (list, tuple)):
            if not isinstance(ga, (list, tuple)) or len(ga) != len(pa):
                raise _NoMatch(f"argument {ga!r} where the pattern has {pa!r}", len(st.nodes))
            for a, b in zip(pa, ga):
                self._match_arg(a, b, st)
            return
        if isinstance(ga, Node) or type(pa) is bool and type(ga) is not bool or pa != ga:
            raise _NoMatch(f"argument {ga if not isinstance(ga, Node) else ga.name!r} where the pattern has the "
                           f"literal {pa!r}", len(st.nodes))

    def _wildcard(self, literal: Any) -> _Wild | None:
        if isinstance(literal, (Node, list, tuple)) or literal is None:
            return None
        key = (torch.dtype if isinstance(literal, torch.dtype) else type(literal), literal)
        try:
            return self.wild_literals.get(key)
        except TypeError:  # unhashable literal
            return None

    # -- replacing --------------------------------------------------------------------------------
    def replace(self, gm: GraphModule, m: Match) -> list[Node]:
        """Insert the replacement for ``m`` before its anchor, reroute the anchor's users, erase the match;
        returns the new nodes (with ``meta["val"]``)."""
        graph, env, new = gm.graph, {}, []
        placeholders = [n for n in self.replace_graph.nodes if n.op == "placeholder"]
        for pn, name in zip(placeholders, self.input_names):
            if name in m.bindings:
                env[pn] = m.bindings[name]
            elif name in self._wild_of_name:
                raise ValueError(f"pattern {self.name!r}: wildcard {name!r} is not used by the search pattern")

        def subst(a):
            if isinstance(a, Node):
                return env[a]
            if isinstance(a, (list, tuple)):
                return type(a)(subst(x) for x in a)
            wild = self._wildcard(a)
            return m.bindings[wild.name] if wild is not None else a

        result = None
        with graph.inserting_before(m.anchor):
            for rn in self.replace_graph.nodes:
                if rn.op == "call_function":
                    node = graph.call_function(rn.target, subst(rn.args), subst(rn.kwargs))
                    env[rn] = node
                    new.append(node)
                elif rn.op == "output":
                    out = rn.args[0]
                    result = subst(out[0] if isinstance(out, (tuple, list)) else out)
                elif rn.op != "placeholder":
                    raise ValueError(f"pattern {self.name!r}: the replacement uses {rn.op} nodes; only operators")
        refresh_meta_val(gm, new)
        if isinstance(result, Node) and "val" not in result.meta and "val" in m.anchor.meta:
            result.meta["val"] = m.anchor.meta["val"]
        m.anchor.replace_all_uses_with(result)
        for gn in reversed([n for n in graph.nodes if n in set(m.nodes.values())]):
            if not gn.users:
                graph.erase_node(gn)
        return new


@dataclass
class _State:
    match: Match
    nodes: dict
    bound: dict
    wild: dict = field(default_factory=dict)

    def copy(self):
        return dict(self.nodes), dict(self.bound), dict(self.wild)

    def restore(self, saved) -> None:
        self.nodes, self.bound, self.wild = (dict(s) for s in saved)


def _trace(fn: Callable, args: list) -> GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    import fxcompiler.ops.fused  # noqa: F401  (fxc::* ops a replacement may call)

    with torch.no_grad():
        return make_fx(fn)(*args)


class PatternMatcherPass:
    """A pass that applies its registered patterns to every candidate node, in graph order, once.

    ``count_key`` names the info entry holding the total number of replacements; ``by_pattern``
    holds the counts per pattern and ``blocked`` (when nothing matched) why the closest candidate
    did not. ``must_fire=True`` makes the pass manager warn when nothing matched."""

    requires = PassRequirements(meta_val=True)

    def __init__(self, name: str, *, count_key: str = "matched", must_fire: bool = False):
        self.name = name
        self.count_key = count_key
        self.must_fire = must_fire
        self.patterns: list[Pattern] = []

    def register_replacement(self, search: Callable, replace: Callable, example_inputs: Sequence[Any],
                             extra_check: Callable[[Match], bool] | None = None, name: str | None = None
                             ) -> "PatternMatcherPass":
        self.patterns.append(Pattern(search, replace, example_inputs, extra_check, name))
        return self

    def __call__(self, gm: GraphModule, ctx: CompileContext | None = None) -> PassResult:
        counts = {p.name: 0 for p in self.patterns}
        closest: dict[str, tuple[int, str]] = {}
        for pattern in self.patterns:
            for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target == pattern.anchor.target]:
                if getattr(node, "_erased", False):  # erased by an earlier match
                    continue
                try:
                    m = pattern.match(node)
                except _NoMatch as exc:
                    if exc.depth > closest.get(pattern.name, (-1, ""))[0]:
                        closest[pattern.name] = (exc.depth, f"at {node.name!r}: {exc}")
                    continue
                pattern.replace(gm, m)
                counts[pattern.name] += 1
        total = sum(counts.values())
        info: dict[str, Any] = {self.count_key: total}
        if len(self.patterns) > 1:
            info["by_pattern"] = counts
        if total == 0:
            info["blocked"] = "; ".join(
                f"{p.name}: " + (f"closest candidate {closest[p.name][1]}" if p.name in closest
                                 else f"no {p.anchor.target} node in the graph") for p in self.patterns)
        return PassResult(gm, total > 0, info)


def replace_pattern(gm: GraphModule, search: Callable, replace: Callable, example_inputs: Sequence[Any],
                    extra_check: Callable[[Match], bool] | None = None) -> int:
    """One-shot: replace every match of ``search`` in ``gm`` by ``replace``; returns how many."""
    p = PatternMatcherPass("replace_pattern")
    p.register_replacement(search, replace, example_inputs, extra_check)
    result = p(gm)
    if result.modified:
        gm.recompile()
    return result.info["matched"]
