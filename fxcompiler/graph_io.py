"""Serialise an ATen-level ``GraphModule`` as Python code plus constant tensors, and back.

The optimised graphs carry ``fxc::*`` custom ops, prepacked weights as placeholders and
symbolic shapes, which ``torch.export.save`` cannot take without re-exporting; their
generated code, however, is a complete description (DESIGN §5: "serialised with
``torch.export.save`` or as code"). Loading re-traces that code with ``torch.fx`` (the
same route ``GraphModule`` pickling takes), so the loaded graph has the same nodes,
targets and names. ``meta['val']`` is not part of the code: :func:`placeholder_signature`
records the placeholders' symbolic shapes and :func:`restore_meta` re-derives every
node's fake value from them when a later build step needs it.
"""
from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import torch

_HEADER = "# fxcompiler graph blob: ATen-level torch.fx code (see docs/artifact-format.md)\n"
_SAFE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SAFE_FILE_STEM = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,127}$")


def is_safe_name(name: object) -> bool:
    """Whether ``name`` can name a file of a cache entry (letters, digits, ``_``, ``-``; no path)."""
    return isinstance(name, str) and bool(_SAFE_FILE_STEM.match(name))


def _ensure_ops_registered() -> None:
    """The ``fxc`` op namespace must exist before code that calls it is traced."""
    import fxcompiler.ops  # noqa: F401


def graph_module_source(gm: torch.fx.GraphModule) -> str:
    """Self-contained Python source of ``gm.forward`` (imports included)."""
    from torch.fx.graph_module import _format_import_block
    from torch.package import sys_importer

    code = gm.graph.python_code(root_module="self")
    return _HEADER + _format_import_block(code.globals, sys_importer) + code.src


def graph_constants(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """Tensors the graph reads with ``get_attr`` (embedded constants), by attribute path."""
    out: dict[str, torch.Tensor] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            value = gm
            for part in n.target.split("."):
                value = getattr(value, part)
            if isinstance(value, torch.Tensor):
                out[n.target] = value.detach()
            else:
                raise TypeError(f"get_attr node {n.name!r} reads a {type(value).__name__}; only tensors serialise")
    return out


class DeferredGraphModule:
    """A GraphModule built by ``build`` on first use (:meth:`materialize`, or any attribute read).

    A warm start whose pipelines come from the build cache never uses the whole program's graph: tracing its
    code again cost ~0.07 s of CPU per start. ``build`` must work from data verified when the deferral was made
    (the compile cache keeps the verified source in memory), never re-read a file."""

    def __init__(self, build: Callable[[], torch.fx.GraphModule]):
        self._build, self._gm, self._lock = build, None, threading.Lock()

    def materialize(self) -> torch.fx.GraphModule:
        with self._lock:
            if self._gm is None:
                self._gm, self._build = self._build(), None
        return self._gm

    def __getattr__(self, name: str) -> Any:  # only for names this object lacks: the graph module's
        if name.startswith("__") or name in ("_build", "_gm", "_lock"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)


def materialize(gm: "torch.fx.GraphModule | DeferredGraphModule") -> torch.fx.GraphModule:
    """``gm`` itself, or the graph module a :class:`DeferredGraphModule` stands for."""
    return gm.materialize() if isinstance(gm, DeferredGraphModule) else gm


class _KeepModules(torch.fx.Tracer):
    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return True


def load_graph_module(source: str, constants: dict[str, torch.Tensor] | None = None,
                      class_name: str = "FxcGraph", node_names: list[str] | None = None) -> torch.fx.GraphModule:
    """Rebuild a GraphModule from :func:`graph_module_source` output and its constants.

    ``node_names``: the names the nodes had when the source was generated (one per node, in order);
    the tracer would otherwise name each node after its target (``embedding`` -> ``embedding_default``)."""
    from torch.fx.graph_module import _forward_from_src

    _ensure_ops_registered()
    if "def forward(self" not in source:
        raise ValueError("graph source has no 'def forward(self, ...)'")
    forward = _forward_from_src(source, {})
    root = type(class_name, (torch.nn.Module,), {"forward": forward})()
    for path, tensor in (constants or {}).items():
        owner = root
        *parents, leaf = path.split(".")
        for part in parents:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        if not _SAFE_NAME.match(leaf):
            raise ValueError(f"constant name {path!r} is not a Python identifier path")
        owner.register_buffer(leaf, tensor)
    graph = _KeepModules().trace(root)
    if node_names is not None:
        graph = _renamed(graph, node_names)
    return torch.fx.GraphModule(root, graph, class_name=class_name)


def _renamed(graph: torch.fx.Graph, names: list[str]) -> torch.fx.Graph:
    """A copy of ``graph`` whose nodes carry ``names`` (a fresh namespace, so no name is suffixed)."""
    nodes = list(graph.nodes)
    if len(nodes) != len(names) or len(set(names)) != len(names) or not all(
            isinstance(n, str) and _SAFE_NAME.match(n) for n in names):
        raise ValueError(f"node_names: expected {len(nodes)} distinct identifiers, one per node, "
                         f"got {len(names)}")
    out = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node, name in zip(nodes, names):
        if node.op == "placeholder" and node.name != name:
            raise ValueError(f"node_names: placeholder {node.name!r} is named {name!r}")
        args = torch.fx.map_arg(node.args, env.__getitem__)
        kwargs = torch.fx.map_arg(node.kwargs, env.__getitem__)
        new = out.create_node(node.op, node.target, args, kwargs, name=name, type_expr=node.type)
        new.meta = dict(node.meta)
        if new.name != name:
            raise ValueError(f"node_names: {name!r} could not be given to node {node.name!r}")
        env[node] = new
    return out


def placeholder_signature(gm: torch.fx.GraphModule) -> dict[str, Any] | None:
    """``{"placeholders": {name: {"shape": [...], "dtype": str}}, "hints": {symbol: int}}``.

    Dimensions are ints or symbol names; None when a placeholder has no fake value or a
    dimension is a compound expression (the graph then cannot get its meta back)."""
    phs, hints = {}, {}
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        shape = []
        for d in val.shape:
            if isinstance(d, int):
                shape.append(d)
                continue
            expr = d.node.expr
            if not getattr(expr, "is_Symbol", False):
                return None
            shape.append(str(expr))
            hints[str(expr)] = int(d.node.hint) if d.node.hint is not None else 2
        phs[n.name] = {"shape": shape, "dtype": str(val.dtype).removeprefix("torch.")}
    return {"placeholders": phs, "hints": hints}


def restore_meta(gm: torch.fx.GraphModule, signature: dict[str, Any]) -> None:
    """Give every node back its ``meta['val']`` by fake propagation from ``signature``."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from .pass_manager import propagate_fake_shapes

    env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    symbols: dict[str, Any] = {}
    for name, hint in signature["hints"].items():
        sym = env.create_symbol(int(hint), source=ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
        symbols[name] = env.create_symintnode(sym, hint=int(hint))
    phs = signature["placeholders"]
    with mode:
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                spec = phs.get(n.name)
                if spec is None:
                    raise ValueError(f"graph signature has no entry for placeholder {n.name!r}")
                shape = [symbols[d] if isinstance(d, str) else d for d in spec["shape"]]
                n.meta["val"] = torch.empty(shape, dtype=getattr(torch, spec["dtype"]))
    propagate_fake_shapes(gm)
