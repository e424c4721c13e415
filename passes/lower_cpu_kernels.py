"""``lower_cpu_kernels``: matmuls on parameter weights become ``fxc::linear`` on weights
prepacked at build time, where the build-time autotuner says the kernel wins.

Requires: matmuls whose weight is a lifted parameter placeholder, in any of the forms the
capture and the layout passes leave: ``aten.matmul/mm(x, W[K, N])`` (``weight_layout``,
``fuse_projections``), optionally followed by ``aten.add.Tensor(·, bias[N])``;
``aten.addmm(bias, x, W[K, N])`` (GPT-2's Conv1D); ``aten.linear(x, W[N, K], bias)`` (when
``weight_layout`` is off). Weights fp32 or bf16 on the CPU, activations of the same dtype; other
dtypes (fp64, fp16) are left alone. Place it after ``weight_layout``/``fuse_projections``.

Ensures: the same function up to fp32 accumulation order (``fxc::linear`` accumulates in fp32
and rounds once, bias included; the ATen bf16 path rounds the matmul and the bias add
separately). Signature: each lowered weight ``W`` becomes a new parameter input
``<W's name>.packed`` (:func:`fxcompiler.ops.linear.pack_linear_weight` layout: fp32
``[P, K, 32]``, bf16 ``[P, ceil(K/2), 32, 2]``): that is what the pipeline binds and what a
param file stores. ``W`` is dropped, and its memory released, when nothing else reads it; a
tied embedding keeps its ``[V, K]`` table for the lookup.

Who measures, who decides (the layering rule: passes import only ``fxcompiler``):

* the *tuner* measures. It is any :class:`fxcompiler.ops.linear.LinearKernelTuner` — ``isa()``
  and ``measure(k, n, dtype, baseline, ms)`` — and reaches the pass as
  ``ctx.options["kernel_tuner"]`` (set by ``fxcompiler/build.py`` for CPU builds to a
  ``backends.cpu.autotune.LinearAutotuner``, which times the real kernels and caches results
  per (K, N, dtype, ISA, kernel sources, torch version) in ``cache_dir``), or as the
  ``tuner=`` option of this pass (tests, users with their own measurements);
* the *pass* decides, per distinct (K, N, dtype, baseline): the weighted geometric mean of
  ``t_aten(M) / t_fxc(M)`` over ``ms`` (default M = 1 and 64; M = 1 weighs ``decode_weight`` =
  0.5: batch-1 decode and batched decode/prefill count alike, as a serving engine's throughput
  is made at M >= 16) must exceed ``min_speedup`` (default 1.0). The choice and the
  timings go to ``PassResult.info["decisions"]`` and one log line per shape.

``force=True`` lowers every eligible matmul without measuring. Fallbacks: kernels unavailable
(the tuner's ISA is ``'aten'``: no compiler, a CPU without AVX2, ``FXCOMPILER_CPU_ISA=aten``),
or no tuner and not forced: nothing is lowered, with one warning per pass run (not per node).
"""
from __future__ import annotations

import logging
import math
import warnings
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

    def __init__(self, force: bool = False, tuner: LinearKernelTuner | None = None, ms: tuple[int, ...] = (1, 64),
                 decode_weight: float = 0.5, min_speedup: float = 1.0):
        self.force = force
        self.tuner = tuner
        self.ms = tuple(ms)
        self.decode_weight = decode_weight
        self.min_speedup = min_speedup

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
        return {"k": site.k, "n": site.n, "dtype": str(site.dtype).removeprefix("torch."), "baseline": site.baseline,
                "use_fxc": speedup > self.min_speedup, "speedup": round(speedup, 3),
                "fxc_us": {m: round(t.fxc[m] * 1e6, 2) for m in sorted(t.fxc)},
                "aten_us": {m: round(t.aten[m] * 1e6, 2) for m in sorted(t.aten)}, "cached": t.cached}

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
        lowered = 0
        for site in sites:
            key = (site.k, site.n, site.dtype, site.baseline)
            if key not in decisions:
                if self.force:
                    decisions[key] = {"k": site.k, "n": site.n, "dtype": str(site.dtype).removeprefix("torch."),
                                      "baseline": site.baseline, "use_fxc": True, "forced": True}
                else:
                    decisions[key] = d = self._decide(tuner, site)
                    log.info("lower_cpu_kernels: K=%d N=%d %s: fxc::linear %.2fx vs %s (%s%s) -> %s", site.k, site.n,
                             d["dtype"], d["speedup"], site.baseline,
                             ", ".join(f"M={m} {d['fxc_us'][m]}/{d['aten_us'][m]} us" for m in d["fxc_us"]),
                             ", cached" if d["cached"] else "", "fxc::linear" if d["use_fxc"] else "ATen")
            if not decisions[key]["use_fxc"]:
                continue
            spec = ctx.placeholder_spec(site.w)
            if spec.target not in packed:
                weight = ctx.param_of(site.w)
                packed[spec.target] = ctx.add_param_input(
                    gm, spec.target + ".packed", pack_linear_weight(weight.t() if site.transposed else weight))
                del weight
            with graph.inserting_before(site.out):
                new = graph.call_function(torch.ops.fxc.linear.default, (site.x, packed[spec.target], site.bias, site.n))
            new.meta["val"] = _val(site.out)
            site.out.replace_all_uses_with(new)
            for node in site.erase:
                graph.erase_node(node)
            ctx.drop_param_if_unused(gm, site.w)
            lowered += 1
        dropped = ctx.drop_unused_params(gm)
        info.update(lowered=lowered, kept=len(sites) - lowered, decisions=list(decisions.values()),
                    packed_params=len(packed), dropped_params=dropped)
        log.info("lower_cpu_kernels: %d of %d parameter matmuls -> fxc::linear (isa %s%s), %d weights prepacked",
                 lowered, len(sites), info["isa"], ", forced" if self.force else "", len(packed))
        return PassResult(gm, lowered > 0, info)
