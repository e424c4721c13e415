"""Standalone reproducers of a rejected pass.

When a pass is rejected (it raised, broke the graph or failed a numeric check) and dumps are
on, :class:`fxcompiler.instruments.DumpInstrument` writes ``repro-NN-<pass>/``:

    graph.py      the graph the pass received, as self-contained Python (fxcompiler.graph_io)
    state.pt      its parameters, embedded constants, input specs, geometry, placeholder
                  signature (symbolic shapes) and example inputs
    pass.json     how to get the pass back: a registered name (+ options) or "module:attribute"
    replay.py     ``python replay.py``: rebuilds the graph, runs the pass and the checks

:func:`replay` runs the pass under :class:`~fxcompiler.pass_manager.VerifyInstrument` ("each"),
then compares the graph before and after on the example inputs (tolerance of the model's
dtype) and checks the logits are finite; it raises the same :class:`PassError` the build did.
A pass defined in a script or a test cannot be re-imported: edit ``pass.json`` (or pass
``p=`` to :func:`replay`) to point at it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from . import graph_io
from .capture import InputSpec, ModelGeometry
from .pass_manager import CompileContext, Pass, PassError, PassManager, VerifyInstrument, resolve_pass

REPLAY_SCRIPT = '''"""Replays the rejected pass of this reproducer: python replay.py (exit status 1 when it is rejected)."""
import sys
from pathlib import Path

from fxcompiler.pass_manager import PassError
from fxcompiler.repro import replay

try:
    replay(Path(__file__).resolve().parent)
except PassError as exc:
    print(f"PassError: {exc}", file=sys.stderr)
    sys.exit(1)
print("the pass was accepted")
'''


def pass_reference(p: Pass) -> dict[str, Any]:
    """How :func:`replay` can get ``p`` back: its registered name and options, or an import path."""
    key = getattr(p, "cache_key", None)
    if isinstance(key, str) and key.count(":") >= 2:  # name:options-json:source (get_pass)
        name, _, rest = key.partition(":")
        options = json.loads(rest.rpartition(":")[0])
        return {"name": p.name, "registered": name, "options": options}
    fn = getattr(p, "fn", p)
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    ref = f"{module}:{qualname}" if module and qualname and "<locals>" not in qualname else None
    return {"name": p.name, "import": ref}


def write_reproducer(directory: Path, p: Pass, gm: GraphModule, ctx: CompileContext,
                     inputs: dict[str, torch.Tensor], error: str) -> Path:
    """Write a reproducer of ``p`` run on ``gm`` (the graph it received; ``ctx`` as it was) into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "graph.py").write_text(graph_io.graph_module_source(gm))
    state = {
        "input_specs": [dataclasses.astuple(s) for s in ctx.input_specs],
        "params": {k: v for k, v in ctx.params.items() if any(s.target == k for s in ctx.input_specs)},
        "constants": graph_io.graph_constants(gm),
        "geometry": dataclasses.asdict(ctx.geometry),
        "signature": graph_io.placeholder_signature(gm),
        "inputs": inputs,
    }
    torch.save(state, directory / "state.pt")
    (directory / "pass.json").write_text(json.dumps({**pass_reference(p), "error": error}, indent=1))
    (directory / "replay.py").write_text(REPLAY_SCRIPT)
    return directory


def load_reproducer(directory: Path) -> tuple[GraphModule, CompileContext, dict[str, torch.Tensor], dict]:
    """The graph (with ``meta['val']``), context, example inputs and pass reference of a reproducer."""
    directory = Path(directory)
    state = torch.load(directory / "state.pt", weights_only=False)
    gm = graph_io.load_graph_module((directory / "graph.py").read_text(), state["constants"])
    if state["signature"] is not None:
        graph_io.restore_meta(gm, state["signature"])
    ctx = CompileContext([InputSpec(*s) for s in state["input_specs"]], dict(state["params"]),
                         ModelGeometry(**state["geometry"]))
    return gm, ctx, state["inputs"], json.loads((directory / "pass.json").read_text())


def replay(directory: Path, p: Pass | None = None, tolerance: float | None = None) -> dict:
    """Run the reproducer's pass (or ``p``) with shape verification after it, then compare the graph
    before and after on the example inputs and check the logits are finite. Raises the
    :class:`PassError` of a rejected pass; returns the pass's record when it is accepted."""
    from .instruments import NUMERIC_TOLERANCE
    from .numerics import describe_difference, first_divergent_node, graph_snapshot, record_values
    from .testing import run_program

    gm, ctx, inputs, ref = load_reproducer(directory)
    if p is None:
        if ref.get("registered"):
            p = resolve_pass(ref["registered"], **ref.get("options", {}))
        elif ref.get("import"):
            p = resolve_pass(ref["import"])
        else:
            raise ValueError(f"{directory}/pass.json cannot name the pass {ref.get('name')!r} (defined inside a "
                             "function); call replay(directory, p=the_pass)")
    before_gm = graph_snapshot(gm)
    before_ctx = CompileContext(list(ctx.input_specs), dict(ctx.params), ctx.geometry)
    expected = run_program(before_gm, before_ctx, inputs)
    gm = PassManager([p], [VerifyInstrument("each")])(gm, ctx)
    got = run_program(gm, ctx, inputs)
    floats = [t.dtype for t in ctx.params.values() if t.is_floating_point()] + [ctx.geometry.dtype]
    tol = tolerance or max(NUMERIC_TOLERANCE.get(d, 1e-2) for d in floats)
    for name, g, e in [("logits", got[0], expected[0])] + [(k, got[1][k], expected[1][k]) for k in expected[1]]:
        what = describe_difference(name, g, e, tol)
        if what is not None:
            node = first_divergent_node(record_values(before_gm, before_ctx, inputs), gm, ctx, inputs, tol, p.name)
            raise PassError(f"numeric check: pass {p.name!r} {what}" + (f"; {node}" if node else ""))
    return ctx.history[-1]
