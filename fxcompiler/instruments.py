"""Pass instruments that make every graph the compiler produces visible.

``DumpInstrument(dir)`` writes, for each pass, the graph before and after as readable
Python (``NN-<pass>.before.py`` / ``.after.py``), a Graphviz picture (``.after.dot``) and
a node-count/op histogram diff (``NN-<pass>.diff.txt``), plus ``summary.json`` with the
per-pass wall time and what each pass reported. Switched on by
``compiler_config_overrides={"dump_dir": DIR}`` or the ``FXCOMPILER_DUMP_DIR`` variable.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import torch
from torch.fx import GraphModule

from .pass_manager import CompileContext, Pass, PassError, PassInstrument, PassResult


def op_histogram(gm: GraphModule) -> Counter:
    return Counter(str(n.target) if n.op == "call_function" else n.op for n in gm.graph.nodes)


def graph_to_dot(gm: GraphModule, name: str = "graph") -> str:
    """A compact DOT rendering: one box per node, edges from inputs (placeholders elided when params)."""
    lines = [f'digraph "{name}" {{', "  rankdir=TB; node [shape=box, fontsize=10];"]
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name.startswith(("p_", "b_", "c_")):
            continue
        label = n.name if n.op != "call_function" else f"{n.name}\\n{str(n.target).replace('aten.', '')}"
        style = ', style=filled, fillcolor="#ffd7a8"' if "fxc." in str(n.target) else ""
        lines.append(f'  "{n.name}" [label="{label}"{style}];')
        for a in n.all_input_nodes:
            if not (a.op == "placeholder" and a.name.startswith(("p_", "b_", "c_"))):
                lines.append(f'  "{a.name}" -> "{n.name}";')
    lines.append("}")
    return "\n".join(lines)


class DumpInstrument(PassInstrument):
    def __init__(self, directory: str | os.PathLike, prefix: str = ""):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.index = 0
        self.summary: list[dict] = []
        self._before: Counter | None = None

    def run_before_pass(self, p: Pass, gm: GraphModule, ctx: CompileContext) -> None:
        self.index += 1
        self._before = op_histogram(gm)
        (self._stem(p).with_suffix(".before.py")).write_text(gm.code)

    def run_after_pass(self, p: Pass, result: PassResult, ctx: CompileContext, seconds: float) -> None:
        gm = result.graph_module
        stem = self._stem(p)
        stem.with_suffix(".after.py").write_text(gm.code)
        stem.with_suffix(".after.dot").write_text(graph_to_dot(gm, p.name))
        after = op_histogram(gm)
        keys = sorted(set(after) | set(self._before or {}))
        rows = [f"{'op':60s} {'before':>7s} {'after':>7s} {'delta':>7s}"]
        for k in keys:
            b, a = (self._before or {}).get(k, 0), after.get(k, 0)
            if a != b:
                rows.append(f"{k:60s} {b:7d} {a:7d} {a - b:+7d}")
        total_b, total_a = sum((self._before or {}).values()), sum(after.values())
        rows.append(f"{'TOTAL nodes':60s} {total_b:7d} {total_a:7d} {total_a - total_b:+7d}")
        stem.with_suffix(".diff.txt").write_text("\n".join(rows) + "\n")
        self.summary.append({"index": self.index, "pass": p.name, "modified": result.modified,
                             "seconds": round(seconds, 4), "nodes_before": total_b, "nodes_after": total_a,
                             **result.info})  # JSON by the pass contract
        (self.dir / f"{self.prefix}summary.json").write_text(json.dumps(self.summary, indent=1))

    def _stem(self, p: Pass) -> Path:
        return self.dir / f"{self.prefix}{self.index:02d}-{p.name}"


NUMERIC_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}


class NumericCheckInstrument(PassInstrument):
    """Runs the graph before and after each pass on the same random inputs (one small
    mixed prefill/decode-like shape: ``batch`` sequences of ``tokens`` new tokens after
    ``context`` cached ones) and raises :class:`PassError` naming the pass when the
    logits or the written KV caches differ by more than ``tolerance`` relative to the
    largest reference value. The tolerance defaults to the lowest-precision float dtype
    among the parameters after the pass (fp64 1e-9, fp32 1e-4, bf16 6e-2).

    Switched on by ``compiler_config_overrides={"numeric_check": True}`` (or a dict of
    this class's keyword arguments) or ``FXCOMPILER_NUMERIC_CHECK=1``."""

    def __init__(self, batch: int = 2, tokens: int = 5, context: int = 11, block_size: int = 4, seed: int = 0,
                 tolerance: float | None = None):
        from .testing import TestBucket

        self.bucket = TestBucket(batch, tokens, context, block_size)
        self.seed = seed
        self.tolerance = tolerance
        self.report: list[dict] = []
        self._expected = None

    def _run(self, gm: GraphModule, ctx: CompileContext):
        from .testing import inputs_for_geometry, run_program

        return run_program(gm, ctx, inputs_for_geometry(ctx.geometry, self.bucket, self.seed))

    def run_before_pass(self, p: Pass, gm: GraphModule, ctx: CompileContext) -> None:
        self._expected = self._run(gm, ctx)

    def run_after_pass(self, p: Pass, result: PassResult, ctx: CompileContext, seconds: float) -> None:
        if not result.modified:
            return
        logits, caches = self._run(result.graph_module, ctx)
        exp_logits, exp_caches = self._expected
        floats = [t.dtype for t in ctx.params.values() if t.is_floating_point()] + [ctx.geometry.dtype]
        tol = self.tolerance or max(NUMERIC_TOLERANCE.get(d, 1e-2) for d in floats)
        worst = 0.0
        for name, got, exp in [("logits", logits, exp_logits)] + [(k, caches[k], exp_caches[k]) for k in exp_caches]:
            if got.shape != exp.shape:
                raise PassError(f"numeric check: pass {p.name!r} changed the shape of {name} "
                                f"from {list(exp.shape)} to {list(got.shape)}")
            scale = exp.double().abs().max().item() + 1e-6
            err = (got.double() - exp.double()).abs().max().item() / scale
            worst = max(worst, err)
            if not err <= tol:
                raise PassError(f"numeric check: pass {p.name!r} changed {name} by {err:.3g} (max abs difference "
                                f"relative to max |reference|; tolerance {tol:g}) on bucket {self.bucket}")
        self.report.append({"pass": p.name, "max_relative_error": worst, "tolerance": tol})


def instruments_from_options(options: dict) -> list[PassInstrument]:
    """The instruments a build asks for: graph verification (``FXCOMPILER_VERIFY_PASSES``),
    dumps when a dump dir is set, numeric checks when asked for."""
    from .pass_manager import verify_instruments_from_env

    out: list[PassInstrument] = verify_instruments_from_env()
    check = options.get("numeric_check")
    if check is None and os.environ.get("FXCOMPILER_NUMERIC_CHECK", "0") not in ("", "0"):
        check = True
    if check:
        out.append(NumericCheckInstrument(**(check if isinstance(check, dict) else {})))
    dump = options.get("dump_dir") or os.environ.get("FXCOMPILER_DUMP_DIR")
    if dump:
        out.append(DumpInstrument(dump))
    return out
