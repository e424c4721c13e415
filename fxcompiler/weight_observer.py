"""Weight observers: how a group's (or channel's) quantization grid is chosen from its values.

Requires a ``[N, g]`` float block of weights (one group of ``g`` columns, or a whole row for per-channel
schemes) and, optionally, a non-negative importance per column (GPTQ passes the Hessian's diagonal).
Ensures a grid on fxcompiler's own layouts (:mod:`fxcompiler.ops.quant_linear`):

* ``minmax`` (the default): RTN's formulas. Asymmetric int4 ``s = (max − min)/15``, ``m = min``; symmetric int4
  ``s = −(value of largest magnitude)/8``, ``m = −8·s``; fp8 ``s = amax/448``.
* ``mse``: a search for the grid of least (importance-weighted) squared rounding error, as llama.cpp's
  ``make_qkx2_quants`` does for its K-quants. Asymmetric int4: for each of its 21 candidate step sizes
  (``(15 + t)/(max − min)`` codes per unit, ``t`` in ``[−1, 1]`` by 0.1) the codes rounded from the min, the
  least-squares scale and min for those codes, and the error of the codes re-rounded on that grid.
  Symmetric int4 the same with the scale alone (``m = −8·s``, 21 steps within ±12.5 % of min-max's).
  fp8: 32 candidate scales ``amax/448 · 2^(j/32)``, ``j`` in ``[0, 32)`` (one octave: e4m3's relative grid
  repeats every power of two; no value is clamped).
  The min-max grid is always a candidate and the best is kept, so each group's error is at most min-max's
  (least-squares sums in float64, errors in float32: up to float32 rounding of the sums).
"""
from __future__ import annotations

import torch

__all__ = ["OBSERVERS", "check_observer", "int4_grid", "fp8_scale", "int4_codes"]

OBSERVERS = ("minmax", "mse")
FP8_MAX = 448.0


def check_observer(observer: str, what: str = "observer") -> str:
    """``observer`` if it is one of :data:`OBSERVERS`, else a ValueError naming ``what``."""
    if observer not in OBSERVERS:
        raise ValueError(f"{what} must be one of {', '.join(OBSERVERS)}, got {observer!r}")
    return observer


def int4_codes(w: torch.Tensor, s: torch.Tensor, m: torch.Tensor, symmetric: bool) -> torch.Tensor:
    """Codes of ``w [N, c]`` on per-row ``s, m [N, 1]`` (RTN's rounding, clamped to [0, 15])."""
    if symmetric:
        safe = torch.where(s != 0, s, torch.ones_like(s))
        return torch.clamp(torch.round(w / safe) + 8, 0, 15)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return torch.clamp(torch.round((w - m) / safe), 0, 15)


def _minmax_int4(wg: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if symmetric:
        idx = wg.abs().argmax(dim=1, keepdim=True)
        scale = -torch.gather(wg, 1, idx).squeeze(1) / 8.0
        return scale, -8.0 * scale
    lo, hi = wg.amin(dim=1), wg.amax(dim=1)
    return (hi - lo) / 15.0, lo


def _weights(imp: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if imp is None:
        return torch.ones(1, like.shape[1], dtype=torch.float32)
    imp = imp.to(torch.float32).clamp_min(0)
    return imp.reshape(1, -1) if imp.dim() == 1 else imp


def _int4_error(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, m: torch.Tensor, symmetric: bool) -> torch.Tensor:
    """Weighted squared error per row of ``x [R, g]`` rounded on the grids ``s, m [R]`` (the kernels' arithmetic)."""
    s, m = s[:, None], m[:, None]
    return ((int4_codes(x, s, m, symmetric) * s + m - x) ** 2 * w).sum(dim=1)


def int4_grid(wg: torch.Tensor, symmetric: bool, observer: str = "minmax", importance: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale [R], min [R])`` (fp32) of the groups ``wg [R, g]`` (one group a row); ``importance`` (``[g]`` or
    ``[R, g]``, non-negative) weighs the values' errors (a weight 0 leaves a value out)."""
    x = wg.to(torch.float32)
    s0, m0 = _minmax_int4(x, symmetric)
    if observer == "minmax":
        return s0, m0
    check_observer(observer)
    w = _weights(importance, x)
    best_err = _int4_error(x, w, s0, m0, symmetric)
    best_s, best_m = s0.clone(), m0.clone()
    if symmetric:
        # the value of largest magnitude maps to code 0 (−8): codes per unit −8/peak
        peak = -8.0 * s0
        base = torch.where(peak != 0, -8.0 / torch.where(peak != 0, peak, 1.0), torch.zeros_like(peak))
    else:
        lo, hi = x.amin(dim=1), x.amax(dim=1)
        span = hi - lo
        base = torch.where(span > 0, 1.0 / torch.where(span > 0, span, 1.0), torch.zeros_like(span))
        xl = x - lo[:, None]
        wd = w.to(torch.float64)
        sw = wd.sum(dim=1)
        sx = (wd * x).sum(dim=1)
    for t in range(-10, 11):  # llama.cpp make_qkx2_quants' candidates: rmin −1, rdelta 0.1, nstep 20
        if symmetric:
            q = torch.clamp(torch.round(x * (base * (1.0 + t / 80.0))[:, None]), -8, 7)
            wq = w * q
            sql = (wq * q).sum(dim=1, dtype=torch.float64)
            s = ((wq * x).sum(dim=1, dtype=torch.float64) / torch.where(sql > 0, sql, 1.0)).to(torch.float32)
            ok = (sql > 0) & (s != 0)
            m = -8.0 * s
        else:
            q = torch.clamp(torch.round(xl * (base * (15.0 + t / 10.0))[:, None]), 0, 15)
            wq = (w * q).to(torch.float64)
            sl, sl2, sxl = wq.sum(dim=1), (wq * q).sum(dim=1), (wq * x).sum(dim=1)
            det = sw * sl2 - sl * sl
            sdet = torch.where(det > 0, det, torch.ones_like(det))
            s = ((sw * sxl - sx * sl) / sdet).to(torch.float32)
            m = ((sl2 * sx - sl * sxl) / sdet).to(torch.float32)
            ok = (det > 0) & (s > 0)
        s, m = torch.where(ok, s, s0), torch.where(ok, m, m0)
        err = _int4_error(x, w, s, m, symmetric)
        better = ok & (err < best_err)
        best_err = torch.where(better, err, best_err)
        best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
    return best_s, best_m


def _fp8_error(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    s = s[:, None]
    q = torch.clamp(x / s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return ((q * s - x) ** 2 * w).sum(dim=1)


def fp8_scale(w: torch.Tensor, observer: str = "minmax", importance: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row e4m3 scale ``[N, 1]`` (fp32) of ``w [N, K]``; all-zero rows get 1."""
    w = w.to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True)
    s0 = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if observer == "minmax":
        return s0
    check_observer(observer)
    wt = _weights(importance, w)
    best_s, best_err = s0[:, 0].clone(), _fp8_error(w, wt, s0[:, 0])
    for j in range(1, 32):
        s = s0[:, 0] * 2.0 ** (j / 32)
        err = _fp8_error(w, wt, s)
        better = err < best_err
        best_err, best_s = torch.where(better, err, best_err), torch.where(better, s, best_s)
    return best_s[:, None]
