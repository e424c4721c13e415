"""The pass contract and the manager that runs passes over captured graphs (DESIGN §4).

A pass is any object with a ``name`` and ``__call__(gm, ctx) -> PassResult``. Passes
that change which parameters the graph reads (layout changes, quantisation,
constant embedding) edit ``ctx.input_specs`` / ``ctx.params`` alongside the graph.
Built-in passes register themselves by name with :func:`register_pass`; the
pipeline builder asks :func:`build_pass_list` for the ordered list.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import torch
from torch.fx import GraphModule

from .capture import InputSpec, ModelGeometry

log = logging.getLogger("fxcompiler.passes")


@dataclass
class PassResult:
    graph_module: GraphModule
    modified: bool
    info: dict = field(default_factory=dict)


@dataclass
class CompileContext:
    """What passes may read and edit besides the graph: parameters, signature, options."""

    input_specs: list[InputSpec]
    params: dict[str, torch.Tensor]
    geometry: ModelGeometry
    options: dict[str, Any] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)

    def placeholder_spec(self, node: torch.fx.Node) -> InputSpec | None:
        for spec in self.input_specs:
            if spec.name == node.name:
                return spec
        return None

    def param_of(self, node: torch.fx.Node) -> torch.Tensor | None:
        """The parameter value behind a placeholder node, or None for user inputs/other nodes."""
        if node.op != "placeholder":
            return None
        spec = self.placeholder_spec(node)
        return self.params.get(spec.target) if spec is not None and spec.kind == "param" else None

    def add_param_input(self, gm: GraphModule, target: str, value: torch.Tensor) -> torch.fx.Node:
        """Add a new lifted-parameter placeholder (before the user inputs) bound to ``value``."""
        graph = gm.graph
        first_user = next(n for n in graph.nodes if n.op == "placeholder"
                          and (s := self.placeholder_spec(n)) is not None and s.kind == "user")
        with graph.inserting_before(first_user):
            node = graph.placeholder(_sanitize(target))
        node.meta["val"] = _fake_like(value)
        index = next(i for i, s in enumerate(self.input_specs) if s.kind == "user")
        self.input_specs.insert(index, InputSpec(node.name, "param", target))
        self.params[target] = value
        return node

    def drop_param_if_unused(self, gm: GraphModule, node: torch.fx.Node) -> bool:
        """Erase a parameter placeholder nobody reads any more and release its value now
        (so a pass that re-lays weights out never holds two copies of the model)."""
        spec = self.placeholder_spec(node) if node.op == "placeholder" else None
        if spec is None or spec.kind != "param" or node.users:
            return False
        gm.graph.erase_node(node)
        self.input_specs.remove(spec)
        if not any(s.target == spec.target for s in self.input_specs):
            self.params.pop(spec.target, None)
        return True

    def drop_unused_params(self, gm: GraphModule) -> int:
        """Remove parameter placeholders without users (and their values); returns how many."""
        return sum(self.drop_param_if_unused(gm, n) for n in list(gm.graph.nodes) if n.op == "placeholder")


def _sanitize(target: str) -> str:
    return "p_" + "".join(c if c.isalnum() else "_" for c in target)


def _fake_like(value: torch.Tensor):
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")


@runtime_checkable
class Pass(Protocol):
    name: str

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult: ...


class FunctionPass:
    """Adapts ``fn(gm, ctx) -> PassResult | GraphModule | None`` to the :class:`Pass` contract."""

    def __init__(self, fn: Callable, name: str | None = None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "user_pass")

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        out = self.fn(gm, ctx)
        if isinstance(out, PassResult):
            return out
        if isinstance(out, GraphModule):
            return PassResult(out, True)
        return PassResult(gm, True)

    def __repr__(self) -> str:
        return f"FunctionPass({self.name})"


PASS_REGISTRY: dict[str, Callable[..., Pass]] = {}


def register_pass(name: str):
    """Class/function decorator: make a pass constructible by name (``get_pass(name, **opts)``)."""

    def deco(factory):
        if name in PASS_REGISTRY and PASS_REGISTRY[name] is not factory:
            raise ValueError(f"a pass named {name!r} is already registered")
        PASS_REGISTRY[name] = factory
        if isinstance(factory, type):
            factory.name = name
        return factory

    return deco


def get_pass(name: str, **options) -> Pass:
    _load_builtin_passes()
    if name not in PASS_REGISTRY:
        raise ValueError(f"unknown pass {name!r}; registered passes: {sorted(PASS_REGISTRY)}")
    obj = PASS_REGISTRY[name](**options) if options or isinstance(PASS_REGISTRY[name], type) else PASS_REGISTRY[name]
    if not isinstance(obj, Pass):
        obj = FunctionPass(obj, name)
    return obj


def _load_builtin_passes() -> None:
    import passes  # noqa: F401  (registers the built-in passes)


class PassError(RuntimeError):
    """A pass raised, or left a graph that fails verification; names the pass (and node)."""


class PassInstrument:
    """Hooks around every pass (MLIR/TVM style); subclass and override what you need."""

    def run_before_pass(self, p: Pass, gm: GraphModule, ctx: CompileContext) -> None: ...

    def run_after_pass(self, p: Pass, result: PassResult, ctx: CompileContext, seconds: float) -> None: ...


class VerifyInstrument(PassInstrument):
    """Graph lint after each pass; a broken graph is reported with the pass name."""

    def run_after_pass(self, p, result, ctx, seconds):
        try:
            result.graph_module.graph.lint()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise PassError(f"pass {p.name!r} produced an invalid graph: {exc}") from exc


class TimingInstrument(PassInstrument):
    def __init__(self):
        self.seconds: dict[str, float] = {}

    def run_after_pass(self, p, result, ctx, seconds):
        self.seconds[p.name] = self.seconds.get(p.name, 0.0) + seconds


class PassManager:
    """Runs passes in order with instruments; each pass's info is kept in ``ctx.history``."""

    def __init__(self, passes: Iterable[Pass], instruments: Iterable[PassInstrument] | None = None):
        self.passes = [p if isinstance(p, Pass) else FunctionPass(p) for p in passes]
        if instruments is None:
            instruments = [VerifyInstrument()] if os.environ.get("FXCOMPILER_VERIFY_PASSES", "1") != "0" else []
        self.instruments = list(instruments)

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> GraphModule:
        done: list[str] = []
        for p in self.passes:
            for ins in self.instruments:
                ins.run_before_pass(p, gm, ctx)
            t0 = time.perf_counter()
            try:
                result = p(gm, ctx)
            except PassError:
                raise
            except Exception as exc:
                raise PassError(f"pass {p.name!r} failed (after passes {done}): {exc}") from exc
            seconds = time.perf_counter() - t0
            if result.modified:
                result.graph_module.recompile()
            for ins in self.instruments:
                ins.run_after_pass(p, result, ctx, seconds)
            ctx.history.append({"pass": p.name, "modified": result.modified, "seconds": seconds, **result.info})
            log.debug("pass %s: modified=%s %.3fs %s", p.name, result.modified, seconds, result.info)
            gm = result.graph_module
            done.append(p.name)
        return gm


DEFAULT_PASSES = ("strip_asserts", "fold_casts", "dce", "fuse_rms_norm", "fuse_silu_mul", "fuse_rope",
                  "weight_layout", "fuse_projections", "dce")


def build_pass_list(options: dict[str, Any] | None = None) -> list[Pass]:
    """The default pipeline, edited by ``options['passes']`` = {"disable": [...], "insert": [(pass, {"after"|"before": name})]}."""
    options = options or {}
    unknown_top = set(options) - {"passes", "dump_dir"}
    if unknown_top:
        raise ValueError(f"compiler_config_overrides has unknown keys {sorted(unknown_top)}; "
                         "expected 'passes' and/or 'dump_dir'")
    spec = options.get("passes", {}) or {}
    unknown = set(spec) - {"disable", "insert"}
    if unknown:
        raise ValueError(f"compiler_config_overrides['passes'] has unknown keys {sorted(unknown)}; "
                         "expected 'disable' and/or 'insert'")
    disabled = set(spec.get("disable", ()))
    _load_builtin_passes()
    for name in disabled:
        if name not in PASS_REGISTRY:
            raise ValueError(f"cannot disable unknown pass {name!r}; registered: {sorted(PASS_REGISTRY)}")
    names = [n for n in DEFAULT_PASSES if n not in disabled]
    result: list[Pass] = [get_pass(n) for n in names]
    for item in spec.get("insert", ()):
        user_pass, where = item if isinstance(item, tuple) else (item, {})
        p = get_pass(user_pass) if isinstance(user_pass, str) else (
            user_pass if isinstance(user_pass, Pass) else FunctionPass(user_pass))
        anchor_key = "after" if "after" in where else "before" if "before" in where else None
        if anchor_key is None:
            result.append(p)
            continue
        anchor = where[anchor_key]
        positions = [i for i, q in enumerate(result) if q.name == anchor]
        if not positions:
            raise ValueError(f"cannot insert pass {p.name!r} {anchor_key} {anchor!r}: no such pass in {[q.name for q in result]}")
        idx = positions[0] + 1 if anchor_key == "after" else positions[0]
        result.insert(idx, p)
    return result
