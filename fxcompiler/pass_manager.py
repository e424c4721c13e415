"""The pass contract and the manager that runs passes over captured graphs
(``docs/writing-a-pass.md``; the pipeline: ``docs/architecture.md``, "The pass library").

A pass is any object with a ``name`` and ``__call__(gm, ctx) -> PassResult``. Passes
that change which parameters the graph reads (layout changes, quantisation,
constant embedding) edit ``ctx.input_specs`` / ``ctx.params`` alongside the graph.
Built-in passes register themselves by name with :func:`register_pass`; the
pipeline builder asks :func:`build_pass_list` for the ordered list.

The contract is enforced by :class:`PassManager`: a pass returns a :class:`PassResult`
and nothing else, its ``info`` is JSON (kept as such in ``pass_history``, dumps and the
compile cache) and may not use the record's own fields (:data:`RESERVED_INFO_KEYS`), and
what it declares in ``requires`` (:class:`PassRequirements`) is checked before it runs.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import weakref
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


# the fields of a pass record (pass_history, summary.json); a pass's info may not use them
RESERVED_INFO_KEYS = frozenset({"pass", "id", "index", "modified", "seconds", "nodes_before", "nodes_after",
                                "cache_hit", "cached_seconds"})

STAGES = ("pre-decompose", "post-decompose")


@dataclass(frozen=True)
class PassRequirements:
    """What a pass declares about where it may run (``requires = PassRequirements(...)`` on the pass).

    * ``stage``: ``"post-decompose"`` (a ``decompose`` pass must run before it) or
      ``"pre-decompose"`` (no ``decompose`` before it); None: either.
    * ``meta_val``: every placeholder and ``call_function`` node must carry ``meta["val"]`` when it runs
      (nodes without one get it from their inputs first, :func:`refresh_meta_val`; an error if that fails).
    * ``after`` / ``before``: pass names that, when present in the pipeline, must run before / after it.

    Order is checked when the pipeline is built (:func:`check_requirements`), ``meta_val`` when the pass
    is about to run; a violation is a :class:`PassError` naming the pass and the requirement."""

    stage: str | None = None
    meta_val: bool = False
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()

    def __post_init__(self):
        if self.stage not in (None, *STAGES):
            raise ValueError(f"PassRequirements.stage must be one of {STAGES} or None, got {self.stage!r}")
        for key in ("after", "before"):
            if isinstance(getattr(self, key), str):
                object.__setattr__(self, key, (getattr(self, key),))


class PassDidNotFire(UserWarning):
    """A pass marked ``must_fire`` left the graph unchanged (a fusion whose silence is a performance bug)."""


def check_pass_result(p: "Pass", result: Any) -> PassResult:
    """``result`` if it honours the contract, with ``info`` normalised to JSON; else a :class:`PassError`
    naming the pass and what is wrong."""
    name = getattr(p, "name", repr(p))
    if not isinstance(result, PassResult):
        raise PassError(f"pass {name!r} returned {type(result).__name__} ({str(result)[:80]!r}); a pass must return "
                        "PassResult(graph_module, modified, info)")
    if not isinstance(result.graph_module, GraphModule):
        raise PassError(f"pass {name!r}: PassResult.graph_module is {type(result.graph_module).__name__}, "
                        "expected a torch.fx.GraphModule")
    if not isinstance(result.modified, bool):
        raise PassError(f"pass {name!r}: PassResult.modified is {type(result.modified).__name__}, expected bool")
    if not isinstance(result.info, dict):
        raise PassError(f"pass {name!r}: PassResult.info is {type(result.info).__name__}, expected a dict")
    clash = sorted(set(result.info) & RESERVED_INFO_KEYS)
    if clash:
        raise PassError(f"pass {name!r}: info keys {clash} are reserved for the pass record "
                        f"({sorted(RESERVED_INFO_KEYS)}); rename them")
    try:
        text = json.dumps(result.info, allow_nan=True)
    except (TypeError, ValueError) as exc:
        bad = [k for k, v in result.info.items() if not _json_ok(v)]
        raise PassError(f"pass {name!r}: info must be JSON (str/int/float/bool/None, lists and dicts with "
                        f"str keys); keys {bad or list(result.info)} are not: {exc}") from None
    info = json.loads(text)
    if set(info) != set(result.info):  # non-str keys were converted
        raise PassError(f"pass {name!r}: info keys must be strings, got {list(result.info)}")
    return PassResult(result.graph_module, result.modified, info)


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


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
    """Adapts a function ``fn(gm, ctx) -> PassResult`` to the :class:`Pass` contract (its
    ``requires`` / ``must_fire`` / ``cache_key`` attributes, when set, carry over)."""

    def __init__(self, fn: Callable, name: str | None = None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "user_pass")
        for attr in ("requires", "must_fire", "cache_key"):
            if hasattr(fn, attr):
                setattr(self, attr, getattr(fn, attr))

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        return self.fn(gm, ctx)

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
        key = f"{name}:{json.dumps(options, sort_keys=True)}:{_source_digest(PASS_REGISTRY[name])}"
    except (TypeError, ValueError, OSError):
        key = None
    if key is not None and getattr(obj, "cache_key", key) == key:
        try:
            obj.cache_key = key
        except AttributeError:
            pass
    return obj


_SOURCE_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _source_digest(factory) -> str:
    """Hash of a registered pass's source, once per factory: ``inspect.getsource`` of a class parses its whole module
    (~15 ms each, 0.3 s for the default pipeline's 20 passes on every build). The code a process runs does not change
    under it, so neither does the digest."""
    try:
        return _SOURCE_DIGESTS[factory]
    except (KeyError, TypeError):
        pass
    import hashlib
    import inspect

    digest = hashlib.sha256(inspect.getsource(factory).encode()).hexdigest()[:16]
    try:
        _SOURCE_DIGESTS[factory] = digest
    except TypeError:  # not weakly referenceable: computed each time
        pass
    return digest


def _load_builtin_passes() -> None:
    import passes  # noqa: F401  (registers the built-in passes)


class PassError(RuntimeError):
    """A pass raised, or left a graph that fails verification; names the pass (and node)."""


class PassInstrument:
    """Hooks around every pass (MLIR/TVM style); subclass and override what you need."""

    def run_before_pass(self, p: Pass, gm: GraphModule, ctx: CompileContext) -> None: ...

    def run_after_pass(self, p: Pass, result: PassResult, ctx: CompileContext, seconds: float) -> None: ...

    def run_after_pipeline(self, gm: GraphModule, ctx: CompileContext) -> None: ...

    def run_after_failed_pass(self, p: Pass, gm: GraphModule, ctx: CompileContext, error: "PassError") -> str | None:
        """``p`` was rejected (it raised, broke the contract or failed a check); ``gm`` is the graph as it
        left it. May return a line to append to the error (where the dump or reproducer went)."""

    def on_pipeline_error(self, gm: GraphModule, ctx: CompileContext, error: "PassError") -> str | None:
        """A check after the whole pipeline failed; may return a line to append to the error."""


class VerifyInstrument(PassInstrument):
    """Checks that every pass leaves a well-formed graph.

    After each pass: ``graph.lint()`` and a tag ``meta['fxc_pass']`` on the nodes the pass
    created. Fake-tensor propagation of shapes and dtypes through the whole graph runs
    after every modifying pass with ``shape_prop="each"`` and once after the pipeline with
    ``"end"`` (the default: propagation costs ~2 s per pass on a 30-layer model). A broken
    graph is a :class:`PassError` naming the pass and the first node that fails: an op that
    no longer accepts its inputs, a node whose recorded ``meta['val']`` dtype or rank
    disagrees with what its inputs produce, or graph outputs whose dtype/rank changed.
    Propagation also refreshes ``meta['val']`` so later passes read true shapes.

    In the default ``"end"`` mode each pass's rewired nodes are also checked locally (each
    run once on its inputs' recorded fake values; for unregistered passes, and registered ones
    that rewired at most ``LOCAL_CHECK_MAX_NODES`` nodes), recording the first failure, so
    that when the propagation at the end trips, the error names the single pass that broke
    the graph (the first whose own nodes failed; else the last pass that touched the node)."""

    def __init__(self, shape_prop: str | bool = "end"):
        if shape_prop is True:
            shape_prop = "each"
        if shape_prop not in (False, "each", "end"):
            raise ValueError(f"shape_prop must be 'each', 'end' or False, got {shape_prop!r}")
        self.shape_prop = shape_prop
        self._outputs: list | None = None
        self._initial_outputs: list | None = None
        self._signatures: dict = {}
        self._order: list[str] = []
        self._local_failure: str | None = None

    def run_before_pass(self, p, gm, ctx):
        self._outputs = _output_signature(gm) if self.shape_prop else None
        if self._initial_outputs is None:
            self._initial_outputs = self._outputs
        for n in gm.graph.nodes:
            n.meta.setdefault("fxc_pass", "capture")
        self._signatures = {n: _node_signature(n) for n in gm.graph.nodes}

    def run_after_pass(self, p, result, ctx, seconds):
        gm = result.graph_module
        changed = []
        for n in gm.graph.nodes:  # tag what the pass created or rewired, for error messages
            if self._signatures.get(n) != _node_signature(n):
                n.meta["fxc_pass"] = p.name
                changed.append(n)
        self._signatures = {}
        self._order.append(p.name)
        try:
            gm.graph.lint()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise PassError(f"pass {p.name!r} produced an invalid graph: {exc}") from exc
        if self.shape_prop == "end" and result.modified and self._local_failure is None and changed and (
                p.name not in PASS_REGISTRY or len(changed) <= LOCAL_CHECK_MAX_NODES):
            self._local_failure = _local_check(gm, changed, p.name)
        if self.shape_prop != "each" or not result.modified:
            return
        propagate_fake_shapes(gm, pass_name=p.name)
        _check_outputs(gm, self._outputs, p.name)

    def run_after_pipeline(self, gm, ctx):
        if self.shape_prop == "end":
            try:
                propagate_fake_shapes(gm, pass_name=None, pass_order=self._order)
                _check_outputs(gm, self._initial_outputs, None)
            except PassError as exc:
                if self._local_failure is None or str(exc) == self._local_failure:
                    raise
                raise PassError(f"{self._local_failure}\n(the check after the pipeline failed with: {exc})") from None


# the local check costs about what full propagation costs per node: run it for user passes and small
# rewrites; the built-in passes that rewrite much of the graph are covered by their property tests
LOCAL_CHECK_MAX_NODES = 64


def _local_check(gm: GraphModule, changed: list[torch.fx.Node], pass_name: str) -> str | None:
    """The error of the first of ``changed`` that fails on its inputs' recorded fake values (meta
    untouched), or None. Only recorded: recorded values can be stale, the final propagation decides."""
    saved = {n: n.meta.get("val") for n in changed}
    try:
        refresh_meta_val(gm, changed, pass_name=pass_name, check=True)
    except PassError as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - best effort
        return None
    finally:
        for n, v in saved.items():
            if v is None:
                n.meta.pop("val", None)
            else:
                n.meta["val"] = v
    return None


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


def propagate_fake_shapes(gm: GraphModule, pass_name: str | None = None, pass_order: list[str] | None = None) -> None:
    """Re-derive every node's ``meta['val']`` from the placeholders' fake values (symbolic
    shapes included); raises :class:`PassError` naming the failing node and the pass that
    created it (``pass_name``, else the node's ``meta['fxc_pass']`` tag; when the node itself
    is as captured, the last pass in ``pass_order`` that touched one of its inputs)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    def culprit(n: torch.fx.Node) -> str:
        if pass_name is not None:
            return f"pass {pass_name!r}"
        own = n.meta.get("fxc_pass", "capture")
        if own not in ("capture", "?"):
            return f"pass {own!r}"  # it last rewired the failing node
        made_by = {a.meta.get("fxc_pass", "?") for a in n.all_input_nodes} - {"capture"}
        order = pass_order or []
        if made_by and all(m in order for m in made_by):
            return f"pass {max(made_by, key=lambda m: len(order) - order[::-1].index(m))!r}"
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
                reason = str(exc).split("\n\nWhile executing")[0].strip().splitlines()[0][:300]
                err = PassError(f"{culprit(n)} broke node {n.name!r} ({n.format_node()}): "
                                f"{type(exc).__name__}: {reason}")
                err.original = exc  # torch's full report, not chained: it would bury this message
                raise err from None
            if isinstance(recorded, torch.Tensor) and isinstance(result, torch.Tensor) and (
                    recorded.dtype != result.dtype or recorded.dim() != result.dim()):
                raise PassError(f"{culprit(n)}: node {n.name!r} ({n.format_node()}) records meta['val'] "
                                f"{recorded.dtype}{list(recorded.shape)} but its inputs give "
                                f"{result.dtype}{list(result.shape)}")
            return result

    with torch.no_grad(), _quiet_torch_logs():
        prop = _Prop(gm, mode)
        prop.extra_traceback = False  # the PassError names the node; torch's traceback of it would bury it
        prop.propagate_dont_convert_inputs(*vals)


def refresh_meta_val(gm: GraphModule, nodes: Iterable[torch.fx.Node] | None = None, *,
                     pass_name: str | None = None, check: bool = False) -> int:
    """Re-derive ``meta["val"]`` of ``nodes`` (default: every ``call_function`` node), in graph order,
    by running each on its inputs' recorded fake values in the graph's fake mode (symbolic shapes
    kept). Cheap for a few nodes, unlike :func:`propagate_fake_shapes` over the whole graph. Nodes
    whose inputs lack a value are skipped. With ``check=True`` a node that fails, or whose recorded
    dtype/rank disagrees with the new value, is a :class:`PassError` naming ``pass_name`` and the node.
    Returns how many nodes got a value."""
    from torch._guards import detect_fake_mode

    wanted = None if nodes is None else set(nodes)
    mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    who = f"pass {pass_name!r}" if pass_name else "a pass"
    with torch.no_grad(), (mode if mode is not None else contextlib.nullcontext()), _quiet_torch_logs():
        return _refresh(gm, wanted, who, check)


def _refresh(gm: GraphModule, wanted: set | None, who: str, check: bool) -> int:
    done = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or (wanted is not None and n not in wanted):
            continue
        missing = []

        def val(a):
            if "val" not in a.meta:
                missing.append(a)
            return a.meta.get("val")

        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), val)
        if missing:
            continue
        recorded = n.meta.get("val")
        try:
            result = n.target(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised with the node named
            if check:
                reason = str(exc).split("\n\nWhile executing")[0].strip().splitlines()[0][:300]
                raise PassError(f"{who} broke node {n.name!r} ({n.format_node()}): {type(exc).__name__}: "
                                f"{reason}") from None
            continue
        if check and isinstance(recorded, torch.Tensor) and isinstance(result, torch.Tensor) and (
                recorded.dtype != result.dtype or recorded.dim() != result.dim()):
            raise PassError(f"{who}: node {n.name!r} ({n.format_node()}) records meta['val'] "
                            f"{recorded.dtype}{list(recorded.shape)} but its inputs give "
                            f"{result.dtype}{list(result.shape)}")
        n.meta["val"] = result
        done += 1
    return done


@contextlib.contextmanager
def _quiet_torch_logs():
    """Silence the fake-tensor / symbolic-shape loggers while checking a graph: a failing op is
    reported as one PassError, not ~20 lines of torch's tracing logs."""
    names = ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes", "torch._dynamo",
             "torch.fx.experimental.recording", "torch._subclasses.fake_utils")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


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


def pass_ids(passes: Iterable[Pass]) -> list[str]:
    """A unique id per pass of a pipeline: its name, or ``name#k`` (k = 1, 2, ...) for a name that occurs
    more than once (the second ``dce`` is ``dce#2``). Placements accept these ids as anchors."""
    names = [p.name for p in passes]
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(f"{n}#{seen[n]}" if names.count(n) > 1 else n)
    return out


def check_requirements(passes: list[Pass]) -> None:
    """Raise a :class:`PassError` naming the first pass whose declared order requirements
    (:class:`PassRequirements` ``stage`` / ``after`` / ``before``) the pipeline violates."""
    names = [p.name for p in passes]
    for i, p in enumerate(passes):
        req = getattr(p, "requires", None)
        if req is None:
            continue
        if not isinstance(req, PassRequirements):
            raise PassError(f"pass {p.name!r}: requires must be a PassRequirements, got {type(req).__name__}")
        earlier, later = names[:i], names[i + 1:]
        if req.stage == "post-decompose" and "decompose" not in earlier:
            raise PassError(f"pass {p.name!r} requires stage 'post-decompose' but no 'decompose' pass runs before "
                            f"it in {names}")
        if req.stage == "pre-decompose" and "decompose" in earlier:
            raise PassError(f"pass {p.name!r} requires stage 'pre-decompose' but 'decompose' runs before it in {names}")
        for other in req.after:
            if other in later and other not in earlier:
                raise PassError(f"pass {p.name!r} must run after {other!r}, which comes later in {names}")
        for other in req.before:
            if other in earlier:
                raise PassError(f"pass {p.name!r} must run before {other!r}, which comes earlier in {names}")


def _check_meta_val(p: Pass, gm: GraphModule) -> None:
    req = getattr(p, "requires", None)
    if req is None or not req.meta_val:
        return
    missing = [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function") and "val" not in n.meta]
    if missing:  # nodes an earlier pass made without a value: derive it from their inputs (cheap)
        refresh_meta_val(gm, missing)
        missing = [n for n in missing if "val" not in n.meta]
    if missing:
        by = sorted({n.meta.get("fxc_pass", "?") for n in missing})
        raise PassError(f"pass {p.name!r} requires meta['val'] on every node, but {len(missing)} nodes lack it "
                        f"(first: {[n.name for n in missing[:5]]}, made by {by}) and it cannot be derived from their "
                        "inputs; the pass that made them should set it")


class PassManager:
    """Runs passes in order with instruments; each pass's record (``pass``, ``id``, ``modified``,
    ``seconds`` and its JSON ``info``) is kept in ``ctx.history``. Enforces the pass contract
    (:func:`check_pass_result`, :class:`PassRequirements`) and, when a pass is rejected, lets every
    instrument add what it knows (``run_after_failed_pass``: the dump, the reproducer) to the error."""

    def __init__(self, passes: Iterable[Pass], instruments: Iterable[PassInstrument] | None = None):
        self.passes = [p if isinstance(p, Pass) else FunctionPass(p) for p in passes]
        check_requirements(self.passes)
        if instruments is None:
            instruments = verify_instruments_from_env()
        self.instruments = list(instruments)

    def __call__(self, gm: GraphModule, ctx: CompileContext) -> GraphModule:
        import warnings

        done: list[str] = []
        for p, pid in zip(self.passes, pass_ids(self.passes)):
            try:
                _check_meta_val(p, gm)
            except PassError as exc:
                raise self._failed(p, gm, ctx, exc) from None
            for ins in self.instruments:
                ins.run_before_pass(p, gm, ctx)
            t0 = time.perf_counter()
            try:
                result = check_pass_result(p, p(gm, ctx))
            except PassError as exc:
                raise self._failed(p, gm, ctx, exc) from exc.__cause__
            except Exception as exc:
                raise self._failed(p, gm, ctx, PassError(f"pass {p.name!r} failed (after passes {done}): "
                                                        f"{type(exc).__name__}: {exc}")) from exc
            seconds = time.perf_counter() - t0
            if result.modified:
                result.graph_module.recompile()
            try:
                for ins in self.instruments:
                    ins.run_after_pass(p, result, ctx, seconds)
            except PassError as exc:
                raise self._failed(p, result.graph_module, ctx, exc) from exc.__cause__
            ctx.history.append({"pass": p.name, "id": pid, "modified": result.modified, "seconds": seconds,
                                **result.info})
            log.debug("pass %s: modified=%s %.3fs %s", pid, result.modified, seconds, result.info)
            if getattr(p, "must_fire", False) and not result.modified:
                why = result.info.get("blocked") or "no candidate nodes (the pass reported no reason)"
                msg = f"pass {pid!r} is marked must_fire but did not change the graph: {why}"
                log.warning(msg)
                warnings.warn(msg, PassDidNotFire, stacklevel=2)
            gm = result.graph_module
            done.append(pid)
        try:
            for ins in self.instruments:
                ins.run_after_pipeline(gm, ctx)
        except PassError as exc:
            notes = [n for ins in self.instruments if (n := ins.on_pipeline_error(gm, ctx, exc))]
            if notes:
                raise PassError("\n".join([str(exc), *notes])) from exc.__cause__
            raise
        return gm

    def _failed(self, p: Pass, gm: GraphModule, ctx: CompileContext, exc: PassError) -> PassError:
        """``exc`` with what each instrument adds about the rejected pass (dump paths, reproducer)."""
        notes = []
        for ins in self.instruments:
            try:
                note = ins.run_after_failed_pass(p, gm, ctx, exc)
            except Exception as inner:  # noqa: BLE001 - the pass's error matters more
                note = f"({type(ins).__name__} could not record the failure: {inner})"
            if note:
                notes.append(note)
        return PassError("\n".join([str(exc), *notes])) if notes else exc


DEFAULT_PASSES = ("decompose", "strip_asserts", "fold_casts", "dce", "cse", "fuse_rms_norm", "fuse_silu_mul",
                  "fuse_rope", "auto_bfloat16_cast", "weight_layout", "logits_slice", "fuse_projections",
                  "quantize", "lower_cpu_kernels", "dce", "fuse_linear_silu_mul", "fuse_linear_add",
                  "fuse_qkv_attention", "dce",
                  "constants")


# compiler_config_overrides keys (docs/writing-a-pass.md); the rest of the dict reaches passes as ctx.options
OVERRIDE_KEYS = ("passes", "dump_dir", "numeric_check", "bisect", "embed_all_constants_into_graph",
                 "do_decompositions_for_model_rewrite", "auto_bfloat16_cast",
                 "quantization",  # passes/quantize.py (set from LLM's quantization arguments)
                 # read by the pipeline builder (blockwise compilation), not by passes
                 "use_blockwise_compile", "num_blocks_per_supertask", "num_blocks_per_pp_stage",
                 # {"plan": ParallelPlan dict, "rank": r, "group": name}: the mppp sharding pass runs first
                 "mppp")


PLACEMENT_KEYS = ("after", "before", "occurrence", "options", "must_fire")
PASSES_SPEC_KEYS = ("disable", "insert", "must_fire")


def build_pass_list(options: dict[str, Any] | None = None) -> list[Pass]:
    """The default pipeline, edited by ``options['passes']`` (a dict, or the same as JSON text)::

        {"disable": ["fuse_projections", "dce#3"],          # a name disables every occurrence, an id one
         "insert": [(my_pass, {"after": "dce#2"}),          # the second dce; plain "dce" is the first
                    {"pass": "fuse_rope", "options": {}, "before": "weight_layout"},
                    {"pass": "my_pkg.passes:my_fusion", "after": "fuse_rope", "must_fire": true}],
         "must_fire": ["fuse_rms_norm"]}                    # warn (PassDidNotFire) when these change nothing

    Anchors are pass ids (:func:`pass_ids`) of the list as built so far; ``"occurrence": k`` is the same
    as ``name#k`` (negative counts from the end). Unknown keys, unknown passes and anchors are errors."""
    options = options or {}
    unknown_top = set(options) - set(OVERRIDE_KEYS)
    if unknown_top:
        raise ValueError(f"compiler_config_overrides has unknown keys {sorted(unknown_top)}; "
                         f"expected some of {list(OVERRIDE_KEYS)}")
    spec = parse_passes_spec(options.get("passes"))
    _load_builtin_passes()
    default_ids = _ids(list(DEFAULT_PASSES))
    disabled = set(spec.get("disable", ()))
    for name in disabled:
        if name not in PASS_REGISTRY and name not in default_ids:
            raise ValueError(f"cannot disable unknown pass {name!r}; registered: {sorted(PASS_REGISTRY)}, "
                             f"ids in the default pipeline: {default_ids}")
    result: list[Pass] = [get_pass(n) for n, i in zip(DEFAULT_PASSES, default_ids)
                          if n not in disabled and i not in disabled]
    if options.get("mppp"):  # sharding comes before every pass that re-lays weights out or prepacks them
        result.insert(0, get_pass("mppp"))
    for item in spec.get("insert", ()):
        p, where = _parse_insert(item)
        anchor_key = "after" if "after" in where else "before" if "before" in where else None
        if anchor_key is None:
            result.append(p)
            continue
        idx = _resolve_anchor(result, where[anchor_key], where.get("occurrence"), p.name, anchor_key)
        result.insert(idx + 1 if anchor_key == "after" else idx, p)
    for name in spec.get("must_fire", ()):
        marked = [q for q, i in zip(result, pass_ids(result)) if name in (q.name, i)]
        if not marked:
            raise ValueError(f"must_fire names {name!r}, which is not in the pipeline {pass_ids(result)}")
        for q in marked:
            q.must_fire = True
    check_requirements(result)
    return result


def parse_passes_spec(spec: Any) -> dict:
    """``compiler_config_overrides['passes']`` as a dict (JSON text is parsed), with its keys checked."""
    if spec is None:
        return {}
    if isinstance(spec, (str, bytes)):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"compiler_config_overrides['passes'] is not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"compiler_config_overrides['passes'] must be a dict (or JSON text of one), "
                         f"got {type(spec).__name__}")
    unknown = set(spec) - set(PASSES_SPEC_KEYS)
    if unknown:
        raise ValueError(f"compiler_config_overrides['passes'] has unknown keys {sorted(unknown)}; "
                         f"expected some of {list(PASSES_SPEC_KEYS)}")
    for key in PASSES_SPEC_KEYS:
        if key in spec and (isinstance(spec[key], (str, dict)) or not isinstance(spec[key], Iterable)):
            raise ValueError(f"compiler_config_overrides['passes'][{key!r}] must be a list, got {spec[key]!r}")
    return spec


def _ids(names: list[str]) -> list[str]:
    return pass_ids([type("_N", (), {"name": n})() for n in names])


def _parse_insert(item: Any) -> tuple[Pass, dict]:
    """One ``insert`` entry: ``(pass, where)``, ``{"pass": ..., **where}`` or a bare pass (appended)."""
    if isinstance(item, dict):
        if "pass" not in item:
            raise ValueError(f"an insert entry given as a dict needs a 'pass' key: {item!r}")
        ref, where = item["pass"], {k: v for k, v in item.items() if k != "pass"}
    elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], dict):
        ref, where = item
    else:
        ref, where = item, {}
    unknown = set(where) - set(PLACEMENT_KEYS)
    if unknown:
        raise ValueError(f"insert of {getattr(ref, 'name', ref)!r}: unknown placement keys {sorted(unknown)}; "
                         f"expected some of {list(PLACEMENT_KEYS)}")
    if "after" in where and "before" in where:
        raise ValueError(f"insert of {getattr(ref, 'name', ref)!r}: give 'after' or 'before', not both")
    if "occurrence" in where and not ("after" in where or "before" in where):
        raise ValueError(f"insert of {getattr(ref, 'name', ref)!r}: 'occurrence' needs 'after' or 'before'")
    opts = where.get("options") or {}
    if not isinstance(opts, dict):
        raise ValueError(f"insert of {ref!r}: 'options' must be a dict, got {opts!r}")
    if isinstance(ref, str):
        p = resolve_pass(ref, **opts)
    elif opts:
        raise ValueError(f"insert of {getattr(ref, 'name', ref)!r}: 'options' apply to passes given by name "
                         "(a registered name or 'module:attribute'); construct the pass object yourself instead")
    else:
        p = ref if isinstance(ref, Pass) else FunctionPass(ref)
    if where.get("must_fire"):
        if p is ref:  # do not mark the caller's object for every later build
            import copy

            p = copy.copy(p)
        p.must_fire = True
    return p, where


def resolve_pass(ref: str, **options) -> Pass:
    """A pass from a registered name (:func:`get_pass`) or an import path ``"package.module:attribute"``
    (a pass object, a function, or a class/factory called with ``options``)."""
    if ":" not in ref:
        return get_pass(ref, **options)
    import importlib

    module, _, attr = ref.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import pass {ref!r}: {exc}") from None
    if isinstance(obj, type) or options:
        obj = obj(**options)
    return obj if isinstance(obj, Pass) else FunctionPass(obj)


def _resolve_anchor(result: list[Pass], anchor: Any, occurrence: Any, name: str, key: str) -> int:
    if not isinstance(anchor, str):
        raise ValueError(f"cannot insert pass {name!r} {key} {anchor!r}: an anchor is a pass name or id (str)")
    base, _, k = anchor.partition("#")
    if k and occurrence is not None:
        raise ValueError(f"cannot insert pass {name!r} {key} {anchor!r}: give the occurrence in the id or in "
                         "'occurrence', not both")
    try:
        k = int(k) if k else (int(occurrence) if occurrence is not None else 1)
    except (TypeError, ValueError):
        raise ValueError(f"cannot insert pass {name!r} {key} {anchor!r}: occurrence must be an integer") from None
    positions = [i for i, q in enumerate(result) if q.name == base]
    if not positions:
        raise ValueError(f"cannot insert pass {name!r} {key} {anchor!r}: no such pass in {pass_ids(result)}")
    if k == 0 or abs(k) > len(positions) or (k < 0 and -k > len(positions)):
        raise ValueError(f"cannot insert pass {name!r} {key} {anchor!r}: {base!r} occurs {len(positions)} times "
                         f"(ids {[pass_ids(result)[i] for i in positions]})")
    return positions[k - 1] if k > 0 else positions[k]


def passes_spec_as_json(spec: Any) -> dict | None:
    """``compiler_config_overrides['passes']`` as JSON (what artifacts and ``--passes-json`` record):
    passes given as objects become ``"module:qualname"`` when importable, else their name with
    ``"importable": false``."""
    spec = parse_passes_spec(spec)
    if not spec:
        return None
    out = {k: list(v) for k, v in spec.items() if k != "insert"}
    inserts = []
    for item in spec.get("insert", ()):
        if isinstance(item, dict):
            ref, where = item["pass"], {k: v for k, v in item.items() if k != "pass"}
        elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], dict):
            ref, where = item
        else:
            ref, where = item, {}
        entry: dict[str, Any] = {"pass": ref} if isinstance(ref, str) else {}
        if not entry:
            fn = getattr(ref, "fn", ref)
            module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
            if module and qualname and "<locals>" not in qualname:
                entry["pass"] = f"{module}:{qualname}"
            else:
                entry.update({"pass": getattr(ref, "name", getattr(fn, "__name__", repr(ref))), "importable": False})
        inserts.append({**entry, **where})
    if inserts:
        out["insert"] = inserts
    return json.loads(json.dumps(out, default=str))
