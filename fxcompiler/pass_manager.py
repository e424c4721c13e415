"""The pass contract and the manager that runs passes over captured graphs (DESIGN §4).

A pass is any object with a ``name`` and ``__call__(gm, ctx) -> PassResult``. Passes
that change which parameters the graph reads (layout changes, quantisation,
constant embedding) edit ``ctx.input_specs`` / ``ctx.params`` alongside the graph.
Built-in passes register themselves by name with :func:`register_pass`; the
pipeline builder asks :func:`build_pass_list` for the ordered list.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import torch
import torch.utils._pytree as pytree
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
        node.meta["val"] = _fake_like(value, graph)
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


def _fake_like(value: torch.Tensor, graph: torch.fx.Graph):
    """A fake tensor for ``value`` in the graph's fake mode (so shape propagation can mix it
    with the exported placeholders); a meta tensor when the graph has no fake values."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])
    if mode is None:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return mode.from_tensor(value, static_shapes=True)


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
    try:  # a registered pass is identified by name, options and source: the compile cache keys on it
        import hashlib
        import inspect

        source = hashlib.sha256(inspect.getsource(PASS_REGISTRY[name]).encode()).hexdigest()[:16]
        key = f"{name}:{json.dumps(options, sort_keys=True)}:{source}"
    except (TypeError, ValueError, OSError):
        key = None
    if key is not None and getattr(obj, "cache_key", key) == key:
        try:
            obj.cache_key = key
        except AttributeError:
            pass
    return obj


def _load_builtin_passes() -> None:
    import passes  # noqa: F401  (registers the built-in passes)


class PassError(RuntimeError):
    """A pass raised, or left a graph that fails verification; names the pass (and node)."""


class PassInstrument:
    """Hooks around every pass (MLIR/TVM style); subclass and override what you need."""

    def run_before_pass(self, p: Pass, gm: GraphModule, ctx: CompileContext) -> None: ...

    def run_after_pass(self, p: Pass, result: PassResult, ctx: CompileContext, seconds: float) -> None: ...

    def run_after_pipeline(self, gm: GraphModule, ctx: CompileContext) -> None: ...


class VerifyInstrument(PassInstrument):
    """Checks that every pass leaves a well-formed graph.

    After each pass: ``graph.lint()`` and a tag ``meta['fxc_pass']`` on the nodes the pass
    created. Fake-tensor propagation of shapes and dtypes through the whole graph runs
    after every modifying pass with ``shape_prop="each"`` and once after the pipeline with
    ``"end"`` (the default: propagation costs ~2 s per pass on a 30-layer model). A broken
    graph is a :class:`PassError` naming the pass and the first node that fails: an op that
    no longer accepts its inputs, a node whose recorded ``meta['val']`` dtype or rank
    disagrees with what its inputs produce, or graph outputs whose dtype/rank changed.
    Propagation also refreshes ``meta['val']`` so later passes read true shapes."""

    def __init__(self, shape_prop: str | bool = "end"):
        if shape_prop is True:
            shape_prop = "each"
        if shape_prop not in (False, "each", "end"):
            raise ValueError(f"shape_prop must be 'each', 'end' or False, got {shape_prop!r}")
        self.shape_prop = shape_prop
        self._outputs: list | None = None
        self._initial_outputs: list | None = None
        self._signatures: dict = {}

    def run_before_pass(self, p, gm, ctx):
        self._outputs = _output_signature(gm) if self.shape_prop else None
        if self._initial_outputs is None:
            self._initial_outputs = self._outputs
        for n in gm.graph.nodes:
            n.meta.setdefault("fxc_pass", "capture")
        self._signatures = {n: _node_signature(n) for n in gm.graph.nodes}

    def run_after_pass(self, p, result, ctx, seconds):
        gm = result.graph_module
        for n in gm.graph.nodes:  # tag what the pass created or rewired, for error messages
            if self._signatures.get(n) != _node_signature(n):
                n.meta["fxc_pass"] = p.name
        try:
            gm.graph.lint()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise PassError(f"pass {p.name!r} produced an invalid graph: {exc}") from exc
        if self.shape_prop != "each" or not result.modified:
            return
        propagate_fake_shapes(gm, pass_name=p.name)
        _check_outputs(gm, self._outputs, p.name)

    def run_after_pipeline(self, gm, ctx):
        if self.shape_prop == "end":
            propagate_fake_shapes(gm, pass_name=None)
            _check_outputs(gm, self._initial_outputs, None)


def _node_signature(n: torch.fx.Node) -> tuple:
    return n.op, n.target, str(n.args), str(n.kwargs)


def _check_outputs(gm: GraphModule, before: list | None, pass_name: str | None) -> None:
    after = _output_signature(gm)
    if before is not None and after != before:
        who = f"pass {pass_name!r}" if pass_name else "the pass pipeline"
        raise PassError(f"{who} changed the graph outputs from {before} to {after} (dtype, rank)")


def _output_signature(gm: GraphModule) -> list:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    vals = []
    for a in pytree.tree_leaves(out.args[0]):
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        vals.append((v.dtype, v.dim()) if isinstance(v, torch.Tensor) else None)
    return vals


def propagate_fake_shapes(gm: GraphModule, pass_name: str | None = None) -> None:
    """Re-derive every node's ``meta['val']`` from the placeholders' fake values (symbolic
    shapes included); raises :class:`PassError` naming the failing node and the pass that
    created it (``pass_name``, else the node's ``meta['fxc_pass']`` tag)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    def culprit(n: torch.fx.Node) -> str:
        if pass_name is not None:
            return f"pass {pass_name!r}"
        made_by = {a.meta.get("fxc_pass", "?") for a in [n, *n.all_input_nodes]} - {"capture"}
        return f"pass {sorted(made_by)[0]!r}" if len(made_by) == 1 else \
            f"one of the passes {sorted(made_by) or ['(capture)']}"

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    missing = [n for n in placeholders if not isinstance(n.meta.get("val"), torch.Tensor)]
    if missing:
        raise PassError(f"{culprit(missing[0])} left placeholders without meta['val']: "
                        f"{[n.name for n in missing[:5]]}")
    vals = [n.meta["val"] for n in placeholders]
    mode = detect_fake_mode(vals) or FakeTensorMode(allow_non_fake_inputs=True)
    vals = [v if getattr(v, "fake_mode", None) is mode else mode.from_tensor(v) for v in vals]

    class _Prop(FakeTensorProp):
        def run_node(self, n):
            recorded = n.meta.get("val")
            try:
                result = super().run_node(n)
            except Exception as exc:  # noqa: BLE001 - re-raised with the node named
                reason = str(exc).split("\n\nWhile executing")[0]
                raise PassError(f"{culprit(n)} broke node {n.name!r} ({n.format_node()}): "
                                f"{type(exc).__name__}: {reason}") from exc
            if isinstance(recorded, torch.Tensor) and isinstance(result, torch.Tensor) and (
                    recorded.dtype != result.dtype or recorded.dim() != result.dim()):
                raise PassError(f"{culprit(n)}: node {n.name!r} ({n.format_node()}) records meta['val'] "
                                f"{recorded.dtype}{list(recorded.shape)} but its inputs give "
                                f"{result.dtype}{list(result.shape)}")
            return result

    with torch.no_grad():
        _Prop(gm, mode).propagate_dont_convert_inputs(*vals)


def verify_instruments_from_env() -> list[PassInstrument]:
    """``FXCOMPILER_VERIFY_PASSES``: ``0`` no checks, ``1`` (default) lint after each pass and
    shape propagation after the pipeline, ``each`` shape propagation after every pass."""
    mode = os.environ.get("FXCOMPILER_VERIFY_PASSES", "1").strip().lower()
    if mode in ("0", "off", "false", "no"):
        return []
    if mode not in ("1", "each", "end", "on", "true", "yes"):
        raise ValueError(f"FXCOMPILER_VERIFY_PASSES must be 0, 1 or 'each', got {mode!r}")
    return [VerifyInstrument("each" if mode == "each" else "end")]


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
            instruments = verify_instruments_from_env()
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
        for ins in self.instruments:
            ins.run_after_pipeline(gm, ctx)
        return gm


DEFAULT_PASSES = ("decompose", "strip_asserts", "fold_casts", "dce", "cse", "fuse_rms_norm", "fuse_silu_mul",
                  "fuse_rope", "auto_bfloat16_cast", "weight_layout", "logits_slice", "fuse_projections",
                  "quantize", "lower_cpu_kernels", "dce", "fuse_qkv_attention", "dce",
                  "constants")


# compiler_config_overrides keys (docs/writing-a-pass.md); the rest of the dict reaches passes as ctx.options
OVERRIDE_KEYS = ("passes", "dump_dir", "numeric_check", "embed_all_constants_into_graph",
                 "do_decompositions_for_model_rewrite", "auto_bfloat16_cast",
                 "quantization",  # passes/quantize.py (set from LLM's quantization arguments)
                 # read by the pipeline builder (blockwise compilation), not by passes
                 "use_blockwise_compile", "num_blocks_per_supertask", "num_blocks_per_pp_stage",
                 # {"plan": ParallelPlan dict, "rank": r, "group": name}: the mppp sharding pass runs first
                 "mppp")


def build_pass_list(options: dict[str, Any] | None = None) -> list[Pass]:
    """The default pipeline, edited by ``options['passes']`` = {"disable": [...], "insert": [(pass, {"after"|"before": name})]}."""
    options = options or {}
    unknown_top = set(options) - set(OVERRIDE_KEYS)
    if unknown_top:
        raise ValueError(f"compiler_config_overrides has unknown keys {sorted(unknown_top)}; "
                         f"expected some of {list(OVERRIDE_KEYS)}")
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
    if options.get("mppp"):  # sharding comes before every pass that re-lays weights out or prepacks them
        result.insert(0, get_pass("mppp"))
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
