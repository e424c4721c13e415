"""``lower_cpu_kernels``: matmuls on parameter weights become ``fxc::linear`` on weights
prepacked at build time, where the build-time autotuner says the kernel wins.

Requires: matmuls whose weight is a lifted parameter placeholder, in any of the forms the
capture and the layout passes leave: ``aten.matmul/mm(x, W[K, N])`` (``weight_layout``,
``fuse_projections``), optionally followed by ``aten.add.Tensor(·, bias[N])``;
``aten.addmm(bias, x, W[K, N])`` (GPT-2's Conv1D); ``aten.linear(x, W[N, K], bias)`` (when
``weight_layout`` is off). Weights fp32 or bf16 on the CPU, activations of the same dtype; other
dtypes (fp64, fp16) are left alone. Place it after ``weight_layout``/``fuse_projections``. The
``quantize`` pass's ops (``fxc::linear_w8``, ``linear_w4``, ``linear_f8``, ``linear_w8a8``, ``linear_w4a8``,
``linear_f8f8``) are not ATen
matmuls and are left as they are: their kernel is fixed, there is no float candidate to time them against.

Ensures: the same function up to fp32 accumulation order (``fxc::linear`` accumulates in fp32
and rounds once, bias included; the ATen bf16 path rounds the matmul and the bias add
separately). Signature: each lowered weight ``W`` becomes a new parameter input
``<W's name>.packed`` (:func:`fxcompiler.ops.linear.pack_linear_weight` layout: fp32
``[P, K, 32]``, bf16 ``[P, ceil(K/2), 32, 2]``): that is what the pipeline binds and what a
param file stores. ``W`` is dropped, and its memory released, when nothing else reads it (a
``fxc::linear_by_m`` node reads it: the ATen layout for its ATen ranges of M; a tied embedding keeps
its ``[V, K]`` table for the lookup).

Who measures, who decides (the layering rule: passes import only ``fxcompiler``):

* the *tuner* measures. It is any :class:`fxcompiler.ops.linear.LinearKernelTuner` — ``isa()``
  and ``measure(k, n, dtype, baseline, ms)`` — and reaches the pass as
  ``ctx.options["kernel_tuner"]`` (set by ``fxcompiler/build.py`` for CPU builds to a
  ``backends.cpu.autotune.LinearAutotuner``, which times the real kernels and caches results
  per (K, N, dtype, ISA, kernel sources, torch version) in ``cache_dir``), or as the
  ``tuner=`` option of this pass (tests, users with their own measurements);
* the *pass* decides, per distinct (K, N, dtype, baseline) **and per range of M** (the rows of x:
  1 at batch-1 decode, the batch at batched decode, the tokens of a prefill chunk; one shape-dynamic
  graph serves them all). The tuner times both candidates at each M of ``ms`` (default 1, 16, 64,
  256). First the *uniform* choice: the weighted geometric mean of ``t_aten(M) / t_fxc(M)`` (M = 1
  weighs ``decode_weight`` = 0.5, the other Ms share the rest) must exceed ``min_speedup`` (default
  1.0). Then, with ``per_m_range`` (default on), each measured M departs from the uniform choice where
  the other candidate is faster there by more than ``range_margin`` (default 1.1×; a smaller gain does
  not pay for a second copy of the weight). A measured M stands for the rows between the geometric
  midpoints with its neighbours (M = 16 and 64: rows 5…32 go with 16), and neighbouring Ms with the same
  choice merge into one range (:func:`plan_m_ranges`). One choice for every M: ``fxc::linear`` (or
  ATen, untouched), as before; different choices: ``fxc::linear_by_m``, which picks per call from M and
  holds **both** layouts of the weight (the packed one and the ATen one), so such a node costs its
  weight's memory twice (``PassResult.info["dual_layout_bytes"]``). Those second copies are capped at
  ``max_dual_fraction`` (default 0.25) of the matched weights' bytes: the shapes whose ranges gain most
  (``range_gain``: the weighted ``|log speedup|`` at the Ms they change) go first, the others keep their
  uniform choice. The choice, the plan and the timings go to ``PassResult.info["decisions"]`` and one log
  line per shape.

``force=True`` lowers every eligible matmul without measuring. Fallbacks: kernels unavailable
(the tuner's ISA is ``'aten'``: no compiler, a CPU without AVX2, ``FXCOMPILER_CPU_ISA=aten``),
or no tuner and not forced: nothing is lowered, with one warning per pass run (not per node).
"""
from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from fxcompiler.ops.linear import LinearKernelTuner, pack_linear_weight
from fxcompiler.pass_manager import CompileContext, PassRequirements, PassResult, register_pass

aten = torch.ops.aten
log = logging.getLogger("fxcompiler.passes")

_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class _Site:
    """One matmul to lower: ``out`` is the node whose value ``fxc::linear`` takes over."""

    out: Node
    erase: tuple[Node, ...]  # users before producers
    x: Node
    w: Node
    transposed: bool  # the parameter is [K, N] (matmul/mm/addmm), not [N, K] (linear)
    bias: Node | None
    k: int
    n: int
    dtype: torch.dtype
    baseline: str


@dataclass(frozen=True)
class MRange:
    """Rows ``lo`` … ``hi`` (inclusive; ``hi`` None: unbounded) of x and the kernel chosen for them."""

    lo: int
    hi: int | None
    use_fxc: bool


def plan_m_ranges(speedups: Mapping[int, float], uniform: bool, min_speedup: float = 1.0,
                  range_margin: float = 1.1) -> list[MRange]:
    """The kernel per range of M from ``speedups`` (``t_aten / t_fxc`` at each measured M).

    Each measured M keeps ``uniform`` (the one-choice-for-every-M decision) unless the other candidate
    wins there by more than ``range_margin``: fxc where ``speedup > min_speedup * range_margin``, ATen where
    ``speedup < min_speedup / range_margin``. Measured M_i covers the rows above the geometric midpoint
    with M_(i-1) up to the one with M_(i+1) (the first from 0, the last unbounded); ranges with the same
    choice merge. Returns the ranges in order, covering 0 … unbounded without gaps."""
    if not speedups:
        return [MRange(0, None, uniform)]
    if range_margin < 1.0:
        raise ValueError(f"range_margin must be >= 1, got {range_margin}")
    ms = sorted(speedups)
    choices = []
    for m in ms:
        s = speedups[m]
        choices.append(not s < min_speedup / range_margin if uniform else s > min_speedup * range_margin)
    out: list[MRange] = []
    lo = 0
    for i, (m, c) in enumerate(zip(ms, choices)):
        hi = None if i == len(ms) - 1 else max(m, math.isqrt(m * ms[i + 1]))
        if out and out[-1].use_fxc == c:
            out[-1] = MRange(out[-1].lo, hi, c)
        else:
            out.append(MRange(lo, hi, c))
        lo = (hi or 0) + 1
    return out


def fxc_ranges(plan: list[MRange]) -> list[int]:
    """``fxc::linear_by_m``'s ``fxc_m``: the ``[lo, hi]`` pairs (``hi = -1``: unbounded) where fxc is chosen."""
    return [v for r in plan if r.use_fxc for v in (r.lo, -1 if r.hi is None else r.hi)]


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def _is(node, target) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target


def _bias_ok(b, n: int, dtype: torch.dtype) -> bool:
    v = _val(b)
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape[0] == n and v.dtype == dtype


def _match(node: Node, ctx: CompileContext) -> _Site | None:
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        transposed, baseline = False, "linear"
    elif node.target in (aten.matmul.default, aten.mm.default) and not node.kwargs:
        x, w = node.args
        bias, transposed, baseline = None, True, "matmul"
    elif node.target is aten.addmm.default:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return None
        bias, x, w = node.args[:3]
        transposed, baseline = True, "matmul"
    else:
        return None
    weight = ctx.param_of(w) if isinstance(w, Node) else None
    xv = _val(x)
    if weight is None or weight.dim() != 2 or weight.dtype not in _DTYPES or weight.device.type != "cpu" \
            or not isinstance(xv, torch.Tensor) or xv.dim() < 1 or xv.dtype != weight.dtype:
        return None
    k, n = (int(weight.shape[0]), int(weight.shape[1])) if transposed else (int(weight.shape[1]), int(weight.shape[0]))
    if xv.shape[-1] != k or (bias is not None and not _bias_ok(bias, n, weight.dtype)):
        return None
    out, erase = node, (node,)
    if bias is None and transposed and len(node.users) == 1:
        add = next(iter(node.users))
        if _is(add, aten.add.Tensor) and not add.kwargs and len(add.args) == 2:
            b = add.args[1] if add.args[0] is node else add.args[0]
            if b is not node and _bias_ok(b, n, weight.dtype):
                out, erase, bias = add, (add, node), b
    return _Site(out, erase, x, w, transposed, bias, k, n, weight.dtype, baseline)


@register_pass("lower_cpu_kernels")
class LowerCpuKernelsPass:
    requires = PassRequirements(after=("weight_layout", "fuse_projections"))  # the matmul forms they leave

    def __init__(self, force: bool = False, tuner: LinearKernelTuner | None = None,
                 ms: tuple[int, ...] = (1, 16, 64, 256), decode_weight: float = 0.5, min_speedup: float = 1.0,
                 per_m_range: bool = True, range_margin: float = 1.1, max_dual_fraction: float = 0.25):
        self.force = force
        self.tuner = tuner
        self.ms = tuple(ms)
        self.decode_weight = decode_weight
        self.min_speedup = min_speedup
        self.per_m_range = per_m_range
        self.range_margin = range_margin
        self.max_dual_fraction = max_dual_fraction

    # -- decision ---------------------------------------------------------------------------------
    def _weights(self) -> dict[int, float]:
        ms = sorted(set(self.ms))
        if len(ms) == 1:
            return {ms[0]: 1.0}
        rest = (1.0 - self.decode_weight) / (len(ms) - 1)
        return {m: (self.decode_weight if m == ms[0] else rest) for m in ms}

    def _decide(self, tuner: LinearKernelTuner, site: _Site) -> dict:
        t = tuner.measure(site.k, site.n, site.dtype, site.baseline, self.ms)
        weights = self._weights()
        log_speedup = sum(w * math.log(t.aten[m] / t.fxc[m]) for m, w in weights.items())
        speedup = math.exp(log_speedup)
        uniform = speedup > self.min_speedup
        per_m = {m: t.aten[m] / t.fxc[m] for m in weights}
        plan = (plan_m_ranges(per_m, uniform, self.min_speedup, self.range_margin) if self.per_m_range
                else [MRange(0, None, uniform)])
        # what the ranges win over the uniform choice: weighted |log speedup| at the Ms they change
        gain = sum(weights[m] * abs(math.log(per_m[m])) for m in weights
                   if next(r for r in plan if m >= r.lo and (r.hi is None or m <= r.hi)).use_fxc != uniform)
        return {"k": site.k, "n": site.n, "dtype": str(site.dtype).removeprefix("torch."), "baseline": site.baseline,
                "use_fxc": any(r.use_fxc for r in plan), "ranged": len(plan) > 1, "uniform_fxc": uniform,
                "range_gain": round(gain, 4),
                "plan": [(r.lo, r.hi, "fxc" if r.use_fxc else "aten") for r in plan], "fxc_m": fxc_ranges(plan),
                "speedup": round(speedup, 3),
                "fxc_us": {m: round(t.fxc[m] * 1e6, 2) for m in sorted(t.fxc)},
                "aten_us": {m: round(t.aten[m] * 1e6, 2) for m in sorted(t.aten)}, "cached": t.cached}

    def _dual_budget(self, decisions: dict[tuple, dict], sites: list[_Site], ctx: CompileContext) -> None:
        """Keep the second weight layouts within ``max_dual_fraction`` of the matched weights' bytes: ranged
        shapes in order of ``range_gain`` while they fit; the others fall back to their uniform choice."""
        per_key: dict[tuple, int] = {}
        seen: set[str] = set()
        total = 0
        for site in sites:
            target = ctx.placeholder_spec(site.w).target
            if target in seen:
                continue
            seen.add(target)
            weight = ctx.param_of(site.w)
            nbytes = weight.numel() * weight.element_size()
            total += nbytes
            key = (site.k, site.n, site.dtype, site.baseline)
            per_key[key] = per_key.get(key, 0) + nbytes
        budget = self.max_dual_fraction * total
        for key in sorted((k for k, d in decisions.items() if d["ranged"]), key=lambda k: -decisions[k]["range_gain"]):
            d = decisions[key]
            if per_key.get(key, 0) <= budget:
                budget -= per_key.get(key, 0)
                continue
            u = d["uniform_fxc"]
            d.update(ranged=False, use_fxc=u, plan=[(0, None, "fxc" if u else "aten")], fxc_m=[0, -1] if u else [],
                     dual_budget="exceeded")

    # -- pass ---------------------------------------------------------------------------------------
    def __call__(self, gm: GraphModule, ctx: CompileContext) -> PassResult:
        graph = gm.graph
        sites = [s for node in list(graph.nodes) if (s := _match(node, ctx)) is not None]
        info: dict = {"lowered": 0, "kept": len(sites), "forced": self.force, "isa": None, "decisions": []}
        if not sites:
            return PassResult(gm, False, info)
        tuner = self.tuner if self.tuner is not None else ctx.options.get("kernel_tuner")
        if tuner is None and not self.force:
            warnings.warn("lower_cpu_kernels: no kernel tuner (ctx.options['kernel_tuner'], set by the CPU build, "
                          "or the pass's tuner= option) and force=False: matmuls stay on ATen",
                          RuntimeWarning, stacklevel=2)
            info["reason"] = "no tuner"
            return PassResult(gm, False, info)
        if tuner is not None:
            info["isa"] = tuner.isa()
            if info["isa"] == "aten":
                warnings.warn("lower_cpu_kernels: fxc CPU kernels are unavailable on this machine (no C++ compiler, "
                              "no AVX2, or FXCOMPILER_CPU_ISA=aten): matmuls stay on ATen", RuntimeWarning,
                              stacklevel=2)
                info["reason"] = "kernels unavailable"
                return PassResult(gm, False, info)

        decisions: dict[tuple, dict] = {}
        packed: dict[str, Node] = {}
        dual: dict[str, int] = {}  # weights held in both layouts (fxc::linear_by_m) -> bytes of the ATen copy
        lowered = ranged = 0
        for site in sites:
            key = (site.k, site.n, site.dtype, site.baseline)
            if key in decisions:
                continue
            if self.force:
                decisions[key] = {"k": site.k, "n": site.n, "dtype": str(site.dtype).removeprefix("torch."),
                                  "baseline": site.baseline, "use_fxc": True, "ranged": False, "forced": True}
            else:
                decisions[key] = self._decide(tuner, site)
        if not self.force:
            self._dual_budget(decisions, sites, ctx)
            for (k, n, _dt, baseline), d in decisions.items():
                log.info("lower_cpu_kernels: K=%d N=%d %s: fxc::linear %.2fx vs %s (%s%s) -> %s", k, n,
                         d["dtype"], d["speedup"], baseline,
                         ", ".join(f"M={m} {d['fxc_us'][m]}/{d['aten_us'][m]} us" for m in d["fxc_us"]),
                         ", cached" if d["cached"] else "",
                         ("by M: " + ", ".join(f"{lo}-{'' if hi is None else hi} {c}" for lo, hi, c in d["plan"]))
                         if d["ranged"] else ("fxc::linear" if d["use_fxc"] else "ATen"))
        for site in sites:
            key = (site.k, site.n, site.dtype, site.baseline)
            if not decisions[key]["use_fxc"]:
                continue
            spec = ctx.placeholder_spec(site.w)
            if spec.target not in packed:
                weight = ctx.param_of(site.w)
                packed[spec.target] = ctx.add_param_input(
                    gm, spec.target + ".packed", pack_linear_weight(weight.t() if site.transposed else weight))
                del weight
            with graph.inserting_before(site.out):
                if decisions[key]["ranged"]:  # keeps the ATen layout of the weight too (site.w stays used)
                    new = graph.call_function(torch.ops.fxc.linear_by_m.default,
                                              (site.x, packed[spec.target], site.w, site.transposed, site.bias, site.n,
                                               list(decisions[key]["fxc_m"])))
                    if spec.target not in dual:
                        weight = ctx.param_of(site.w)
                        dual[spec.target] = weight.numel() * weight.element_size()
                        del weight
                else:
                    new = graph.call_function(torch.ops.fxc.linear.default,
                                              (site.x, packed[spec.target], site.bias, site.n))
            new.meta["val"] = _val(site.out)
            site.out.replace_all_uses_with(new)
            for node in site.erase:
                graph.erase_node(node)
            ctx.drop_param_if_unused(gm, site.w)
            lowered += 1
            ranged += bool(decisions[key]["ranged"])
        dropped = ctx.drop_unused_params(gm)
        info.update(lowered=lowered, kept=len(sites) - lowered, ranged=ranged, decisions=list(decisions.values()),
                    packed_params=len(packed), dropped_params=dropped, dual_layout_bytes=sum(dual.values()))
        log.info("lower_cpu_kernels: %d of %d parameter matmuls -> fxc::linear (isa %s%s), %d weights prepacked",
                 lowered, len(sites), info["isa"], ", forced" if self.force else "", len(packed))
        return PassResult(gm, lowered > 0, info)
