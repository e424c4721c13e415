"""Pass instruments that make every graph the compiler produces visible.

``DumpInstrument(dir)`` writes, for each pass, the graph before and after as readable
Python (``NN-<pass>.before.py`` / ``.after.py``), a unified diff of the two
(``NN-<pass>.code.diff``), a Graphviz picture (``.after.dot``) and a node-count/op histogram
diff (``NN-<pass>.diff.txt``), plus ``summary.json`` with the per-pass wall time and what
each pass reported. A rejected pass still gets its ``.after.py`` (the graph as it left it)
and a standalone reproducer (``repro-NN-<pass>/``, :mod:`fxcompiler.repro`). Switched on by
``compiler_config_overrides={"dump_dir": DIR}`` or the ``FXCOMPILER_DUMP_DIR`` variable.

``NumericCheckInstrument`` compares each pass's results with the graph before it (opt-in),
``FiniteCheckInstrument`` checks the optimised graph's logits are finite on example inputs
(always, unless ``FXCOMPILER_VERIFY_PASSES=0``), ``BisectInstrument`` finds the first pass and
node whose results leave the unoptimised graph's (``fxcompiler compile --bisect``).
"""
from __future__ import annotations

import difflib
import json
import logging
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
        from .numerics import graph_snapshot

        self.index += 1
        self._before = op_histogram(gm)
        self._before_code = gm.code
        (self._stem(p).with_suffix(".before.py")).write_text(gm.code)
        # what a reproducer needs if the pass is rejected (the pass edits gm and ctx in place)
        self._snapshot = (graph_snapshot(gm), list(ctx.input_specs), dict(ctx.params))

    def run_after_failed_pass(self, p, gm, ctx, error) -> str:
        from .repro import write_reproducer
        from .testing import TestBucket, inputs_for_geometry

        stem = self._stem(p)
        try:
            code = gm.graph.python_code("self").src  # the graph now (gm.code is stale until recompile)
        except Exception:  # noqa: BLE001 - a graph too broken to print as Python
            code = str(gm.graph)
        stem.with_suffix(".after.py").write_text(code)
        self._write_code_diff(stem, code)
        before, specs, params = self._snapshot
        repro = write_reproducer(self.dir / f"repro-{self.prefix}{self.index:02d}-{p.name}", p, before,
                                 CompileContext(specs, params, ctx.geometry),
                                 inputs_for_geometry(ctx.geometry, TestBucket(2, 5, 11, 4)), str(error))
        self._snapshot = None
        return (f"dump: {stem}.before.py / .after.py / .code.diff; reproducer: {repro} "
                f"(python {repro / 'replay.py'})")

    def on_pipeline_error(self, gm, ctx, error) -> str:
        return f"dumps of every pass: {self.dir}"

    def _write_code_diff(self, stem: Path, after_code: str) -> None:
        diff = difflib.unified_diff(self._before_code.splitlines(keepends=True), after_code.splitlines(keepends=True),
                                    f"{stem.name}.before.py", f"{stem.name}.after.py", n=1)
        stem.with_suffix(".code.diff").write_text("".join(diff))

    def run_after_pass(self, p: Pass, result: PassResult, ctx: CompileContext, seconds: float) -> None:
        gm = result.graph_module
        stem = self._stem(p)
        stem.with_suffix(".after.py").write_text(gm.code)
        self._write_code_diff(stem, gm.code)
        self._snapshot = None
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
    largest reference value, or become NaN/Inf where the reference is finite; the error also
    names the first node whose value diverges (nodes paired by name with the graph before the
    pass). The tolerance defaults to the lowest-precision float dtype among the parameters
    after the pass (fp64 1e-9, fp32 1e-4, bf16 6e-2).

    Switched on by ``compiler_config_overrides={"numeric_check": True}`` (or a dict of
    this class's keyword arguments) or ``FXCOMPILER_NUMERIC_CHECK=1``."""

    label = "numeric check"

    def __init__(self, batch: int = 2, tokens: int = 5, context: int = 11, block_size: int = 4, seed: int = 0,
                 tolerance: float | None = None):
        from .testing import TestBucket

        self.bucket = TestBucket(batch, tokens, context, block_size)
        self.seed = seed
        self.tolerance = tolerance
        self.report: list[dict] = []
        self._expected = None
        self._before = None

    def _inputs(self, ctx: CompileContext):
        from .testing import inputs_for_geometry

        return inputs_for_geometry(ctx.geometry, self.bucket, self.seed)

    def _run(self, gm: GraphModule, ctx: CompileContext):
        from .testing import run_program

        return run_program(gm, ctx, self._inputs(ctx))

    def run_before_pass(self, p: Pass, gm: GraphModule, ctx: CompileContext) -> None:
        from .numerics import graph_snapshot

        self._expected = self._run(gm, ctx)
        self._before = (graph_snapshot(gm), CompileContext(list(ctx.input_specs), dict(ctx.params), ctx.geometry))

    def _tolerance(self, ctx: CompileContext) -> float:
        floats = [t.dtype for t in ctx.params.values() if t.is_floating_point()] + [ctx.geometry.dtype]
        return self.tolerance or max(NUMERIC_TOLERANCE.get(d, 1e-2) for d in floats)

    def run_after_pass(self, p: Pass, result: PassResult, ctx: CompileContext, seconds: float) -> None:
        from .numerics import describe_difference

        before, self._before = self._before, None
        if not result.modified:
            return
        logits, caches = self._run(result.graph_module, ctx)
        exp_logits, exp_caches = self._expected
        tol = self._tolerance(ctx)
        for name, got, exp in [("logits", logits, exp_logits)] + [(k, caches[k], exp_caches[k]) for k in exp_caches]:
            what = describe_difference(name, got, exp, tol)
            if what is not None:
                raise PassError(f"{self.label}: pass {p.name!r} {what} on bucket {self.bucket}"
                                f"{self._locate(p, before, result.graph_module, ctx, tol)}")
        self.report.append({"pass": p.name, "tolerance": tol})

    def _locate(self, p: Pass, before, gm: GraphModule, ctx: CompileContext, tol: float) -> str:
        """``"; first divergent node ..."`` from a node-by-node comparison with the graph before ``p``."""
        from .numerics import first_divergent_node, record_values

        if before is None:
            return ""
        try:
            inputs = self._inputs(ctx)
            found = first_divergent_node(record_values(before[0], before[1], inputs), gm, ctx, inputs, tol, p.name)
        except Exception as exc:  # noqa: BLE001 - the pass's error matters more than the locator's
            return f" (could not locate the node: {type(exc).__name__}: {exc})"
        return f"; {found}" if found else "; no single node diverges (the difference builds up over many nodes)"


class BisectInstrument(NumericCheckInstrument):
    """``fxcompiler compile --bisect``: the graph after each pass is compared with the
    *unoptimised* graph's results (a prefill of ``tokens`` tokens, the model's real weights)
    and the build stops at the first pass whose logits or KV-cache writes diverge, naming it
    and the first node within it whose value diverges from the graph before it."""

    label = "bisect"

    def __init__(self, batch: int = 1, tokens: int = 8, context: int = 0, block_size: int = 4, seed: int = 0,
                 tolerance: float | None = None):
        super().__init__(batch, tokens, context, block_size, seed, tolerance)
        self.checked: list[str] = []

    def run_before_pass(self, p, gm, ctx):
        from .numerics import graph_snapshot

        if self._expected is None:  # the unoptimised graph's results are the reference for every pass
            self._expected = self._run(gm, ctx)
        self._before = (graph_snapshot(gm), CompileContext(list(ctx.input_specs), dict(ctx.params), ctx.geometry))

    def run_after_pass(self, p, result, ctx, seconds):
        super().run_after_pass(p, result, ctx, seconds)
        self.checked.append(p.name)


class FiniteCheckInstrument(PassInstrument):
    """After the pipeline, runs the optimised graph once on small example inputs and raises a
    :class:`PassError` when its logits hold NaN/Inf, naming the first node that produces them
    and the pass that made that node (cheap: one step of a few tokens)."""

    def __init__(self, batch: int = 1, tokens: int = 3, context: int = 5, block_size: int = 4, seed: int = 0):
        from .testing import TestBucket

        self.bucket = TestBucket(batch, tokens, context, block_size)
        self.seed = seed

    def run_after_pipeline(self, gm: GraphModule, ctx: CompileContext) -> None:
        from .numerics import first_nonfinite_node
        from .testing import inputs_for_geometry, run_program

        inputs = inputs_for_geometry(ctx.geometry, self.bucket, self.seed)
        try:
            logits, _ = run_program(gm, ctx, inputs)
        except Exception as exc:  # noqa: BLE001 - the check must not fail builds the verifier accepts
            logging.getLogger("fxcompiler.passes").warning("finite check skipped: the graph did not run on "
                                                           "example inputs: %s: %s", type(exc).__name__, exc)
            return
        if logits.is_floating_point() and not bool(torch.isfinite(logits).all()):
            where = first_nonfinite_node(gm, ctx, inputs)
            raise PassError(f"the optimised graph produces non-finite logits ({int(torch.isnan(logits).sum())} NaN, "
                            f"{int(torch.isinf(logits).sum())} Inf of {logits.numel()}) on example inputs "
                            f"{self.bucket}; first non-finite {where}. `fxcompiler compile MODEL --bisect` "
                            "names the first pass whose results diverge")


def instruments_from_options(options: dict) -> list[PassInstrument]:
    """The instruments a build asks for: graph verification (``FXCOMPILER_VERIFY_PASSES``),
    dumps when a dump dir is set, numeric checks when asked for."""
    from .pass_manager import verify_instruments_from_env

    out: list[PassInstrument] = verify_instruments_from_env()
    if out:  # verification on: the optimised graph's logits must be finite
        out.append(FiniteCheckInstrument())
    if options.get("bisect") or os.environ.get("FXCOMPILER_BISECT", "0") not in ("", "0"):
        bisect = options.get("bisect")
        out.append(BisectInstrument(**(bisect if isinstance(bisect, dict) else {})))
    check = options.get("numeric_check")
    if check is None and os.environ.get("FXCOMPILER_NUMERIC_CHECK", "0") not in ("", "0"):
        check = True
    if check:
        out.append(NumericCheckInstrument(**(check if isinstance(check, dict) else {})))
    dump = options.get("dump_dir") or os.environ.get("FXCOMPILER_DUMP_DIR")
    if dump:
        out.append(DumpInstrument(dump))
    return out
