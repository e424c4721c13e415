"""GPTQ (Frantar et al., 2022): weight rounding that compensates each column's error on the columns not yet
rounded, using the Hessian ``H = 2/n · Σ x xᵀ`` of the linear's calibration inputs.

The algorithm is the reference one (as in the GPTQ repository, AutoGPTQ, gptqmodel and llm-compressor):
dead input columns (``H[i, i] = 0``) are zeroed, ``H += damp · mean(diag H) · I`` (``damp`` 0.01 by default),
``U = chol(H⁻¹)ᵀ`` (upper), then columns are rounded left to right in blocks of ``block_size`` (128): each
column's error ``(w − ŵ) / U[i, i]`` is propagated with ``U[i, i:]`` inside the block, and the block's errors
with ``U[block, rest]`` to the rest. The grids are fxcompiler's own (:mod:`fxcompiler.ops.quant_linear`):

* int4 (``fxc::linear_w4``): per group of ``group_size`` columns a scale **and** a min (``ŵ = fl(s·q) + m``,
  q in [0, 15]), found by the observer on the group's current (already error-updated) weights when the
  first column of the group is reached; symmetric int4 uses RTN's Q4_0 formula (``m = −8·s``);
* int8 (``fxc::linear_w8``): a symmetric scale per output channel (``amax / 127``) from the unrounded weight.
* fp8 (``fxc::linear_f8``): a scale per output channel (the observer's, min-max ``amax / 448``) from the
  unrounded weight; each column rounds to the nearest e4m3 value (ties to even) of ``w / s``.

The observer (:mod:`fxcompiler.weight_observer`) is ``minmax`` (RTN's formulas) by default; ``mse`` searches
each grid for the least squared rounding error, each column's weighted by ``H[i, i]``. ``refit=True`` then
replaces each row's scales (and mins) by the least-squares ones for its final codes under the full Hessian
(:func:`refit_grid`; a row keeps its grid where the solution is not allowed or not better); the codes do not
change.

``act_order=True`` rounds columns in order of decreasing ``H[i, i]``; the groups stay the contiguous groups
of the original column order (scales and mins found up front from the weight, as AutoGPTQ's
``static_groups``), so the result keeps fxcompiler's layout (no ``g_idx``). It is off by default.

With a diagonal Hessian nothing is propagated and GPTQ (default options) gives RTN's codes exactly.

:func:`gptq_quantize_model` runs it over an eager transformers model layer by layer: the inputs of the first
decoder layer are captured once, then for each layer forward hooks accumulate the Hessians of its linears
from the layer's inputs, the linears are quantized, and the layer is run again with the quantized weights to
give the next layer its inputs (so later layers see the quantized earlier ones). With
``true_sequential=True`` (AutoGPTQ's option) the same holds inside a layer: its linears are quantized in
stages (q/k/v, o, gate/up, down for a llama), each stage's Hessians taken with the earlier stages already
quantized (each forward stopped after the stage's last linear).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from .qformat import ModuleScheme
from .weight_observer import check_observer, fp8_scale, int4_codes, int4_grid

__all__ = ["GPTQConfig", "GPTQResult", "gptq_quantize_model", "gptq_quantize_weight", "rtn_quantize_weight",
           "dequantize_codes", "hessian_error", "refit_grid"]


@dataclass(frozen=True)
class GPTQConfig:
    """GPTQ's knobs: ``damp`` (fraction of mean(diag H) added to the diagonal), ``block_size`` (columns per
    lazy-update block), ``act_order`` (columns by decreasing H[i, i]), ``observer`` (how each group's grid is
    chosen, :mod:`fxcompiler.weight_observer`: ``minmax`` or ``mse``, the latter weighing each column's error
    by ``H[i, i]``), ``refit`` (after rounding, the scales and mins of each row that minimise the Hessian
    error for its codes), ``true_sequential`` (inside a decoder layer, each group of linears fed the same
    tensor takes its Hessians from inputs through the layer's already quantized linears)."""

    damp: float = 0.01
    block_size: int = 128
    act_order: bool = False
    observer: str = "minmax"
    refit: bool = False
    true_sequential: bool = False

    def __post_init__(self):
        check_observer(self.observer, "GPTQ observer")
        for name in ("act_order", "refit", "true_sequential"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTQ {name} must be a bool, got {getattr(self, name)!r}")
        if not (isinstance(self.damp, float) and 0 < self.damp < 1):
            raise ValueError(f"GPTQ damp must be a float in (0, 1), got {self.damp!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"GPTQ block_size must be a positive int, got {self.block_size!r}")


# ------------------------------------------------------------------------------------------------
# the grids (exactly the RTN formulas of fxcompiler.ops.quant_linear / quantize_model._rtn)
# ------------------------------------------------------------------------------------------------
def _int8_scale(w: torch.Tensor) -> torch.Tensor:
    amax = w.abs().amax(dim=1, keepdim=True)
    return torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))


def _fp8_round(v: torch.Tensor) -> torch.Tensor:
    """The nearest e4m3 value of ``v`` (ties to even, clamped to ±448), as fp32."""
    return torch.clamp(v, -448.0, 448.0).to(torch.float8_e4m3fn).to(torch.float32)


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int
                     ) -> torch.Tensor:
    """``[N, K]`` fp32 values of codes: int8 and fp8 ``s·q``; int4 ``fl(s·q) + m`` (the kernels' arithmetic)."""
    k = codes.shape[1]
    idx = torch.arange(k) // (k if group == -1 else group)
    q = codes.to(torch.float32)
    if mins is None:
        return q * scales[:, idx]
    return q * scales[:, idx] + mins[:, idx]


def rtn_quantize_weight(w: torch.Tensor, scheme: ModuleScheme, observer: str = "minmax") -> dict[str, torch.Tensor]:
    """RTN of one ``[N, K]`` weight in the qparam layout (``qweight``, ``weight_scale``, ``weight_min``), each
    group's (fp8: each channel's) grid chosen by ``observer`` (int8 is always amax/127)."""
    w = w.detach().to(torch.float32)
    n, k = w.shape
    if scheme.weight == "int8":
        s = _int8_scale(w)
        return {"weight_scale": s, "qweight": torch.clamp(torch.round(w / s), -127, 127).to(torch.int8)}
    if scheme.weight == "fp8":
        s = fp8_scale(w, observer)
        return {"weight_scale": s, "qweight": _fp8_round(w / s).to(torch.float8_e4m3fn)}
    g = scheme.group_size
    groups = -(-k // g)
    pad = groups * g - k  # a shorter last group: padded with its last value, weighted 0
    wg = torch.cat([w, w[:, -1:].expand(n, pad)], 1).reshape(n * groups, g) if pad else w.reshape(n * groups, g)
    imp = None
    if pad:
        imp = torch.ones(n, groups, g)
        imp[:, -1, g - pad:] = 0.0
        imp = imp.reshape(n * groups, g)
    s, m = int4_grid(wg, scheme.symmetric, observer, imp if observer != "minmax" else None)
    codes = int4_codes(wg, s[:, None], m[:, None], scheme.symmetric).reshape(n, groups * g)[:, :k]
    scales, mins = s.reshape(n, groups), m.reshape(n, groups)
    out = {"weight_scale": scales, "qweight": codes.to(torch.uint8)}
    if not scheme.symmetric:
        out["weight_min"] = mins
    return out


def _check_scheme(scheme: ModuleScheme, k: int) -> None:
    if scheme.weight in ("int8", "fp8") and scheme.group_size != -1:
        raise NotImplementedError(f"GPTQ {scheme.weight} weights are per channel (group_size -1); grouped "
                                  f"{scheme.weight} GPTQ is not built")
    if scheme.weight == "int4" and (scheme.group_size <= 0 or scheme.group_size % 2):
        raise ValueError(f"GPTQ int4 needs a positive even group_size, got {scheme.group_size}")
    if scheme.weight not in ("int8", "int4", "fp8"):
        raise ValueError(f"GPTQ quantizes int8, int4 or fp8 weights, got {scheme.weight!r}")


def gptq_quantize_weight(w: torch.Tensor, hessian: torch.Tensor, scheme: ModuleScheme,
                         config: GPTQConfig = GPTQConfig()) -> dict[str, torch.Tensor]:
    """GPTQ of one ``[N, K]`` weight with the ``[K, K]`` Hessian of its inputs; the qparam tensors
    (``qweight``, ``weight_scale``, ``weight_min`` for asymmetric int4), like :func:`rtn_quantize_weight`."""
    W = w.detach().to(torch.float32).clone()
    n, k = W.shape
    _check_scheme(scheme, k)
    H = hessian.detach().to(torch.float32).clone()
    if H.shape != (k, k):
        raise ValueError(f"GPTQ: Hessian shape {tuple(H.shape)} does not match K={k}")
    fp8 = scheme.weight == "fp8"
    int8 = scheme.weight == "int8" or fp8  # per channel, a static scale (fp8: e4m3 codes instead of integers)
    g = k if int8 else scheme.group_size
    groups = -(-k // g)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    scales, mins = torch.empty(n, groups), torch.empty(n, groups)
    static = int8 or config.act_order  # params from the weight up front (int8: per channel, as GPTQ does)
    hdiag = torch.diag(H)
    imp = None if config.observer == "minmax" else hdiag  # the observer weighs each column's error by H[i, i]
    if int8:
        scales[:, 0:1] = fp8_scale(W, config.observer, imp) if fp8 else _int8_scale(W)
    elif config.act_order:
        for j in range(groups):
            sl = slice(j * g, (j + 1) * g)
            s, m = int4_grid(W[:, sl], scheme.symmetric, config.observer, None if imp is None else imp[sl])
            scales[:, j], mins[:, j] = s, m
    perm = torch.argsort(torch.diag(H), descending=True, stable=True) if config.act_order else torch.arange(k)
    W, H = W[:, perm], H[perm][:, perm]
    imp_p = None if imp is None else imp[perm]
    col_group = (perm // g)  # the (original, contiguous) group of each processed column
    damp = config.damp * torch.mean(torch.diag(H))
    H[range(k), range(k)] += damp
    try:
        L = torch.linalg.cholesky(H)
        U = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    except torch.linalg.LinAlgError as exc:
        raise ValueError(f"GPTQ: the damped Hessian is not positive definite (damp={config.damp}); raise the "
                         "damping or use more calibration samples") from exc
    Q = torch.zeros(n, k)
    block = config.block_size if int8 or config.act_order else max(g, config.block_size // g * g)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            gi = int(col_group[col])
            if not static and col % g == 0:  # a new group: its grid from the current (updated) weights
                s, m = int4_grid(W1[:, i:i + g], scheme.symmetric, config.observer,
                                 None if imp is None else imp_p[col:col + g])
                scales[:, gi], mins[:, gi] = s, m
            wcol = W1[:, i]
            s = scales[:, gi]
            if int8:
                q = _fp8_round(wcol / s) if fp8 else torch.clamp(torch.round(wcol / s), -127, 127)
                deq = q * s
            else:
                m = mins[:, gi]
                q = int4_codes(wcol[:, None], s[:, None], m[:, None], scheme.symmetric)[:, 0]
                deq = q * s + m
            Q1[:, i] = q
            err = (wcol - deq) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            E1[:, i] = err
        Q[:, i1:i2] = Q1
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    inv = torch.argsort(perm)
    Q = Q[:, inv]
    if int8:
        scales = scales[:, :1].contiguous()
    if config.refit:
        scales, mins = refit_grid(w.detach().to(torch.float32), hessian, Q, scales, None if int8 else mins,
                                  g, scheme.symmetric)
    if int8:  # Q holds e4m3 values exactly (fp8) or integers (int8)
        return {"weight_scale": scales, "qweight": Q.to(torch.float8_e4m3fn if fp8 else torch.int8)}
    out = {"weight_scale": scales, "qweight": Q.to(torch.uint8)}
    if not scheme.symmetric:
        out["weight_min"] = mins
    return out


def refit_grid(w: torch.Tensor, hessian: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
               mins: torch.Tensor | None, group: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For fixed ``codes [N, K]``, the scales (and mins) of each row minimising its Hessian error
    ``(w − ŵ)ᵀ H (w − ŵ)``, ``ŵ = s·q + m`` per group: one least-squares solve of ``2·G`` unknowns per row (``G``
    for symmetric int4 (``m = −8·s``) and per-channel int8/fp8 (``mins`` None)). A row whose solution has a
    scale the qparam layout forbids (asymmetric int4 ``s < 0``, int8/fp8 ``s ≤ 0``) or a larger error keeps its
    grid."""
    n, k = codes.shape
    per_channel = mins is None
    g = k if per_channel else group
    groups = -(-k // g)
    H = hessian.to(torch.float64)
    q = codes.to(torch.float64)
    if symmetric and not per_channel:
        q = q - 8.0
    onehot = torch.zeros(k, groups, dtype=torch.float64)
    onehot[torch.arange(k), torch.arange(k) // g] = 1.0  # column → group
    wd = w.to(torch.float64)
    hw = wd @ H  # [N, K]
    # M_ss[n, a, b] = Σ_{i∈a, j∈b} q_ni H_ij q_nj ; M_sm[n, a, b] = Σ_{i∈a, j∈b} q_ni H_ij ; M_mm = Σ H_ij
    m_ss = torch.empty(n, groups, groups, dtype=torch.float64)
    m_sm = torch.empty(n, groups, groups, dtype=torch.float64)
    for b in range(groups):
        cols = slice(b * g, min((b + 1) * g, k))
        zq = q[:, cols] @ H[cols, :]  # [N, K]: Σ_{j∈b} q_nj H_ij
        m_ss[:, :, b] = (q * zq) @ onehot
        m_sm[:, b, :] = zq @ onehot  # Σ_{i∈a} Σ_{j∈b} H_ij q_nj  (scale b, min a) → stored transposed
    r_s = (q * hw) @ onehot  # [N, G]
    if per_channel or symmetric:
        A, r = m_ss, r_s
    else:
        m_mm = onehot.T @ H @ onehot  # [G, G]
        r_m = hw @ onehot
        A = torch.cat([torch.cat([m_ss, m_sm], 2),  # m_sm[n, a, b]: scale a with min b
                       torch.cat([m_sm.transpose(1, 2), m_mm.expand(n, groups, groups)], 2)], 1)
        r = torch.cat([r_s, r_m], 1)
    theta0 = scales.to(torch.float64) if per_channel or symmetric else torch.cat([scales, mins], 1).to(torch.float64)
    # a tiny ridge towards the current grid: unknowns H cannot see (dead columns) keep their values
    ridge = 1e-9 * A.diagonal(dim1=1, dim2=2).abs().mean(dim=1).clamp_min(1e-30)
    A = A + ridge[:, None, None] * torch.eye(A.shape[1], dtype=torch.float64)
    theta = torch.linalg.solve(A, (r + ridge[:, None] * theta0)[..., None])[..., 0]
    s_new = theta[:, :groups].to(torch.float32)
    m_new = None if per_channel else (-8.0 * s_new if symmetric else theta[:, groups:].to(torch.float32))

    def err(s, m):
        idx = torch.arange(k) // g
        deq = codes.to(torch.float32) * s[:, idx] + (0.0 if m is None else m[:, idx])
        d = wd - deq.to(torch.float64)
        return ((d @ H) * d).sum(dim=1)

    ok = torch.isfinite(s_new).all(dim=1) & (m_new is None or torch.isfinite(m_new).all(dim=1))
    if per_channel:
        ok &= (s_new > 0).all(dim=1)
    elif not symmetric:
        ok &= (s_new >= 0).all(dim=1)
    s_safe = torch.where(ok[:, None], s_new, scales)
    m_safe = None if per_channel else torch.where(ok[:, None], m_new, mins)
    ok &= err(s_safe, m_safe) <= err(scales, mins)
    s_out = torch.where(ok[:, None], s_new, scales)
    return s_out, (None if per_channel else torch.where(ok[:, None], m_new, mins))


def hessian_error(w: torch.Tensor, tensors: dict[str, torch.Tensor], scheme: ModuleScheme,
                  hessian: torch.Tensor) -> float:
    """``tr(D H Dᵀ)`` for ``D = W − Ŵ`` (∝ ``‖WX − ŴX‖²`` over the calibration inputs)."""
    per_channel = scheme.weight in ("int8", "fp8")
    group = -1 if per_channel else scheme.group_size
    d = (w.to(torch.float64) - dequantize_codes(tensors["qweight"], tensors["weight_scale"],
                                                tensors.get("weight_min", None if per_channel
                                                            else -8.0 * tensors["weight_scale"]),
                                                group).to(torch.float64))
    return float(torch.einsum("nk,kl,nl->", d, hessian.to(torch.float64), d))


# ------------------------------------------------------------------------------------------------
# the sequential driver over an eager transformers model
# ------------------------------------------------------------------------------------------------
@dataclass
class GPTQResult:
    tensors: dict[str, torch.Tensor]  # qparam tensors of every module
    stats: dict[str, dict[str, float]] = field(default_factory=dict)  # per module: gptq / rtn Hessian error
    hessians: dict[str, torch.Tensor] = field(default_factory=dict)  # with keep_hessians=True
    inputs_seen: int = 0


class _Stop(Exception):
    pass


def _decoder_layers(model: torch.nn.Module, modules: list[str]) -> tuple[str, torch.nn.ModuleList]:
    """The ModuleList of decoder layers holding the linears ``modules``."""
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 0:
            inside = [m for m in modules if m.startswith(name + ".")]
            if inside and (best is None or len(inside) > best[2]):
                best = (name, mod, len(inside))
    if best is None or best[2] != len(modules):
        outside = [m for m in modules if best is None or not m.startswith(best[0] + ".")]
        raise NotImplementedError(f"GPTQ runs decoder layer by decoder layer; linear {outside[0]!r} is outside the "
                                  "model's decoder layers")
    return best[0], best[1]


def _accumulate(store: dict, name: str, last: dict):
    """A forward hook adding ``xᵀx`` of the linear's input to ``store[name]`` (fp32 product per call, fp64 sum);
    linears fed the same tensor (q/k/v, gate/up) share one product through ``last``."""
    def hook(_mod, inputs, _out):
        x = inputs[0].detach()
        if last.get("x") is not x:
            x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
            last.update(x=x, xtx=(x2.T @ x2).to(torch.float64), rows=x2.shape[0])
        h, count = store.get(name, (None, 0))
        store[name] = (last["xtx"] if h is None else h + last["xtx"], count + last["rows"])
    return hook


def _stages(layer: torch.nn.Module, mine: list[str], named: dict, h: torch.Tensor, ex: tuple) -> list[list[str]]:
    """The layer's linears in the order its forward calls them, those fed the same tensor (q/k/v, gate/up)
    together: AutoGPTQ's ``true_sequential`` stages."""
    calls: list[tuple[str, torch.Tensor]] = []
    hooks = [named[m].register_forward_hook(lambda _mod, i, _o, m=m: calls.append((m, i[0]))) for m in mine]
    try:
        with torch.no_grad():
            layer(h, *ex[0], **ex[1])
    finally:
        for hk in hooks:
            hk.remove()
    stages: list[list[str]] = []
    seen: set[str] = set()
    prev = None
    for m, x in calls:
        if m in seen:
            continue
        if prev is None or x is not prev:
            stages.append([])
        stages[-1].append(m)
        seen.add(m)
        prev = x
    return stages + [[m for m in mine if m not in seen]] if len(seen) < len(mine) else stages


def _hessians(layer: torch.nn.Module, stage: list[str], named: dict, hidden: list, extra: list, stop: bool) -> dict:
    """``{linear: (Σ xᵀx, rows)}`` of the ``stage``'s linears over the calibration inputs of ``layer``; with
    ``stop`` each forward ends once the stage's last linear has run."""
    store: dict = {}
    last: dict = {}
    hooks = [named[m].register_forward_hook(_accumulate(store, m, last)) for m in stage]
    if stop:
        def halt(_mod, _i, _o):
            raise _Stop
        hooks.append(named[stage[-1]].register_forward_hook(halt))
    try:
        with torch.no_grad():
            for h, (args, kw) in zip(hidden, extra):
                try:
                    layer(h, *args, **kw)
                except _Stop:
                    pass
    finally:
        for hk in hooks:
            hk.remove()
        last.clear()
    return store


def _quantize_linear(lin: torch.nn.Module, m: str, H: torch.Tensor, scheme: ModuleScheme, config: GPTQConfig,
                     result: GPTQResult, keep_hessians: bool) -> None:
    """GPTQ of one linear into ``result``; its weight becomes the quantized values."""
    w = lin.weight.detach().to(torch.float32)
    t = gptq_quantize_weight(w, H, scheme, config)
    rtn = rtn_quantize_weight(w, scheme)
    result.stats[m] = {"gptq": hessian_error(w, t, scheme, H), "rtn": hessian_error(w, rtn, scheme, H)}
    if keep_hessians:
        result.hessians[m] = H
        result.stats[m]["weight"] = w.clone()  # the weight GPTQ saw (for tests)
    for suffix, v in t.items():
        result.tensors[f"{m}.{suffix}"] = v
    per_channel = scheme.weight in ("int8", "fp8")
    group = -1 if per_channel else scheme.group_size
    mins = t.get("weight_min", None if per_channel else -8.0 * t["weight_scale"])
    with torch.no_grad():
        lin.weight.copy_(dequantize_codes(t["qweight"], t["weight_scale"], mins, group).to(lin.weight.dtype))


def gptq_quantize_model(model: torch.nn.Module, samples: list[torch.Tensor], modules: list[str],
                        scheme: ModuleScheme, config: GPTQConfig = GPTQConfig(), *, progress: bool = True,
                        keep_hessians: bool = False) -> GPTQResult:
    """GPTQ every linear of ``modules`` (transformers' names) of the eager causal-LM ``model`` on the
    calibration ``samples`` (``[1, L]`` token ids each), decoder layer after decoder layer. The model's
    linear weights are replaced by their quantized values as it goes."""
    prefix, layers = _decoder_layers(model, modules)
    named = dict(model.named_modules())
    captured: list[tuple[tuple, dict]] = []

    def grab(_mod, args, kwargs):
        captured.append((args, kwargs))
        raise _Stop

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            for ids in samples:
                try:
                    model(input_ids=ids, use_cache=False)
                except _Stop:
                    pass
    finally:
        handle.remove()
    if len(captured) != len(samples):
        raise RuntimeError("GPTQ: the first decoder layer was not reached for every calibration sample")
    hidden = [a[0] if a else kw.pop("hidden_states") for a, kw in captured]
    extra = [(a[1:], kw) for a, kw in captured]
    result = GPTQResult({})
    bar = _progress(len(modules), progress)
    for li, layer in enumerate(layers):
        lname = f"{prefix}.{li}"
        mine = [m for m in modules if m.startswith(lname + ".")]
        stages = _stages(layer, mine, named, hidden[0], extra[0]) if config.true_sequential else [mine]
        for si, stage in enumerate(stages):
            store = _hessians(layer, stage, named, hidden, extra, stop=si < len(stages) - 1)
            for m in stage:
                if m not in store:
                    raise RuntimeError(f"GPTQ: linear {m!r} was not called by its decoder layer")
                xtx, count = store.pop(m)
                _quantize_linear(named[m], m, (2.0 / count) * xtx, scheme, config, result, keep_hessians)
                bar.update(1)
        with torch.no_grad():  # the next layer's inputs, through this layer's quantized weights
            outs = []
            for h, (args, kw) in zip(hidden, extra):
                o = layer(h, *args, **kw)
                outs.append(o[0] if isinstance(o, tuple) else o)
            hidden = outs
    bar.close()
    result.inputs_seen = sum(int(s.numel()) for s in samples)
    return result


class _NoBar:
    def update(self, _n):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm ships with huggingface_hub
        return _NoBar()
    return tqdm(total=total, desc="gptq", unit="module", file=sys.stderr, disable=not enabled)
