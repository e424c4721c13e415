"""``fxc::linear_w4`` / ``fxc::linear_f8``: int4 (scale **and** min per group, GGUF Q4_0/Q4_1 exact) and fp8
(e4m3, scale per output channel) weight-only matmuls.

IR level (importable by passes and backends): schema, fake kernel, ATen reference, and the pure
PyTorch packers/unpackers the ``quantize`` pass and the GGUF repacker use.

``fxc::linear_w4(Tensor x, Tensor w_int4_packed, Tensor scales, Tensor mins, Tensor? bias, int n, int group_size) -> Tensor``
    x ``[..., K]`` fp32 or bf16; returns ``[..., n]`` in x's dtype, fp32 accumulation.

Layout (``NB = 32`` output columns per panel, ``P = ceil(N / 32)``, ``G = ceil(K / group_size)``,
tail columns zero padded, ``K`` even, ``group_size`` even):

* ``w_int4_packed``: ``uint8 [P, K/2, 32]``, ``byte[p, i, j] = q[32p+j, 2i] | q[32p+j, 2i+1] << 4``,
  ``q`` in ``[0, 15]``;
* ``scales``, ``mins``: ``[P, G, 32]``, both ``float32`` or both ``float16`` (:func:`pack_int4`'s
  ``compact``: GGUF's d and m are fp16 values, so Q4_0/Q4_1 blocks keep them in 2 bytes, 0.625 byte per
  weight in all as in the file instead of 0.75; the kernel upcasts them exactly);
* value: ``w[n, k] = fl(fl(scales[g, n] * q[n, k]) + mins[g, n])`` with ``g = k // group_size`` (a
  multiply then an add, each rounded to fp32, no fused multiply-add: what gguf-py's and
  transformers' Q4_1 dequantisation compute, so a repacked GGUF tensor dequantises bit-exactly).

GGUF mapping: Q4_1 (``d·q + m``): scale = d, min = m. Q4_0 (``d·(q − 8)``): scale = d, min = −8·d
(``d·q − 8d`` is exact in fp32 because d is an fp16 value, so it equals ``d·(q − 8)`` bit for bit).
torch's ``_weight_int4pack_mm_for_cpu`` uses ``(q − 8)·s + z``: for Q4_1 that needs ``z = m + 8d``, whose
fp32 rounding is not exact, which is why this op carries the min directly.

``fxc::linear_w4_add(Tensor x, ..., Tensor? bias, Tensor residual, int n, int group_size)``
    ``residual + fxc::linear_w4(...)`` as one op (the sum formed in the output loop), bit for bit the two ops.
``fxc::linear_w4_silu_mul(Tensor x, ..., Tensor? bias, int n, int group_size)``
    ``fxc::silu_mul`` of the halves of ``fxc::linear_w4(...)`` with ``n = 2H``, ``H`` a multiple of 32 (a fused
    gate/up projection and its product; decode rows never write the ``2H``-wide intermediate), bit for bit the
    graph it replaces. Both are emitted by ``passes/fusion.py`` after ``quantize``.

``fxc::linear_f8(Tensor x, Tensor w_f8_packed, Tensor scales, Tensor? bias, int n) -> Tensor``
    x ``[..., K]`` fp32 or bf16; returns ``[..., n]`` in x's dtype, fp32 accumulation.
    ``w_f8_packed``: ``float8_e4m3fn [P, K, 32]`` (``fxc::linear_w8``'s layout, one byte per weight),
    ``scales``: ``float32 [P*32]``, one per output channel, ``s = amax / 448``; value
    ``w[n, k] = s[n] · float(q[n, k])`` (the e4m3 → fp32 upcast is exact; NaN codes stay NaN).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .linear import NB, _composite, _pad_rows, _panels, check_residual, check_silu_mul_width, silu_mul_out
from .fused import silu_mul_reference  # (and defines fxc::silu_mul, which linear_w4_silu_mul's reference calls)

__all__ = ["FP8", "dequantize_linear_weight_fp8", "dequantize_linear_weight_int4", "fp16_if_exact", "linear_f8",
           "linear_f8_reference", "linear_w4", "linear_w4_add", "linear_w4_add_aten", "linear_w4_add_reference",
           "linear_w4_reference", "linear_w4_silu_mul", "linear_w4_silu_mul_aten", "linear_w4_silu_mul_reference",
           "pack_fp8", "pack_int4", "quantize_fp8_codes", "quantize_linear_weight_fp8", "quantize_linear_weight_int4",
           "set_quant_kernel_loader", "unpack_fp8", "unpack_int4"]

_lib = torch.library.Library("fxc", "FRAGMENT")
_lib.define("linear_w4(Tensor x, Tensor w_int4_packed, Tensor scales, Tensor mins, Tensor? bias, int n, "
            "int group_size) -> Tensor")
_lib.define("linear_w4_add(Tensor x, Tensor w_int4_packed, Tensor scales, Tensor mins, Tensor? bias, Tensor residual, "
            "int n, int group_size) -> Tensor")
_lib.define("linear_w4_silu_mul(Tensor x, Tensor w_int4_packed, Tensor scales, Tensor mins, Tensor? bias, int n, "
            "int group_size) -> Tensor")


def _groups(k: int, group_size: int) -> int:
    return -(-k // group_size)


def _check_group(k: int, group_size: int) -> None:
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"int4 group_size must be a positive even number (32, 64, 128), got {group_size}")
    if k % 2:
        raise ValueError(f"int4 packing needs an even K (two values per byte), got K={k}")


def fp16_if_exact(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors as float16 when every value of every one converts to fp16 and back unchanged (GGUF's fp16
    scales and mins, ``-8·d``), else all unchanged: a lossless halving of the bytes a decode step streams."""
    halves = [t.to(torch.float16) for t in ts]
    if all(bool(torch.equal(h.to(t.dtype), t)) for h, t in zip(halves, ts)):
        return tuple(halves)
    return ts


def pack_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int, compact: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack codes ``q`` (uint8 ``[N, K]`` in [0, 15]) with ``scales``/``mins`` (``[N, G]`` fp32) for ``fxc::linear_w4``.

    ``compact``: store scales and mins as float16 when all of them are fp16 values (:func:`fp16_if_exact`),
    which changes no weight and saves 0.125 byte per weight of streaming; float32 otherwise."""
    if q.dim() != 2:
        raise ValueError(f"expected [N, K] int4 codes, got shape {tuple(q.shape)}")
    n, k = q.shape
    _check_group(k, group_size)
    g = _groups(k, group_size)
    if tuple(scales.shape) != (n, g) or tuple(mins.shape) != (n, g):
        raise ValueError(f"scales and mins must be [N={n}, G={g}], got {tuple(scales.shape)} and {tuple(mins.shape)}")
    q = q.to(torch.uint8)
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"int4 codes must be in [0, 15], got a maximum of {int(q.max())}")
    p = _panels(n)
    qp = _pad_rows(q, p * NB).reshape(p, NB, k // 2, 2)
    packed = (qp[..., 0] | (qp[..., 1] << 4)).permute(0, 2, 1).contiguous()  # [P, K/2, 32]

    return (packed, *group_params_layout(scales, mins, p, NB, compact))


def group_params_layout(scales: torch.Tensor, mins: torch.Tensor, panels: int, cols: int, compact: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group scales and mins ``[N, G]`` as ``[panels, G, cols]`` (tail rows zero padded), fp16 where
    ``compact`` and every value is an fp16 value (:func:`fp16_if_exact`): the int4 ops' shared layout."""
    g = scales.shape[1]

    def lay(t):
        return _pad_rows(t.to(torch.float32), panels * cols).reshape(panels, cols, g).permute(0, 2, 1).contiguous()

    s_lay, m_lay = lay(scales), lay(mins)
    return fp16_if_exact(s_lay, m_lay) if compact else (s_lay, m_lay)


def unpack_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, n: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_int4`: ``(q [n, K] uint8, scales [n, G], mins [n, G])``."""
    p, half, nb = packed.shape
    lo, hi = packed & 0x0F, packed >> 4
    q = torch.stack([lo, hi], dim=2).reshape(p, 2 * half, nb).permute(0, 2, 1).reshape(p * nb, 2 * half)[:n]
    g = scales.shape[1]
    s = scales.permute(0, 2, 1).reshape(p * nb, g)[:n]
    m = mins.permute(0, 2, 1).reshape(p * nb, g)[:n]
    return q, s, m


def dequantize_int4_codes(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> torch.Tensor:
    """``fl(fl(s·q) + m)`` per group, fp32 ``[N, K]`` (the op's value definition; fp16 scales and mins are
    upcast first, exactly)."""
    n, k = q.shape
    idx = torch.arange(k) // group_size
    s = scales.float()[:, idx]
    m = mins.float()[:, idx]
    return (q.to(torch.float32) * s) + m


def dequantize_linear_weight_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, n: int,
                                  group_size: int) -> torch.Tensor:
    """The fp32 ``[n, K]`` weight ``fxc::linear_w4`` multiplies by."""
    q, s, m = unpack_int4(packed, scales, mins, n)
    return dequantize_int4_codes(q, s, m, group_size)


def quantize_linear_weight_int4(w: torch.Tensor, group_size: int = 128, symmetric: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 of a ``[N, K]`` weight, packed for ``fxc::linear_w4``.

    Asymmetric (default, Q4_1-like): per group ``scale = (max − min) / 15``, ``min = min``,
    ``q = round((w − min) / scale)``. Symmetric (Q4_0-like): ``scale = −absmax_signed / 8`` as
    llama.cpp does (the value of largest magnitude maps to −8), ``min = −8·scale``.
    A last group shorter than ``group_size`` (K not a multiple) is allowed. Error per value ≤ scale/2."""
    if w.dim() != 2:
        raise ValueError(f"expected a [N, K] weight, got shape {tuple(w.shape)}")
    w = w.detach().to(device="cpu", dtype=torch.float32)
    n, k = w.shape
    _check_group(k, group_size)
    g = _groups(k, group_size)
    pad = g * group_size - k
    wg = torch.cat([w, w[:, -1:].expand(n, pad)], 1) if pad else w  # pad with a real value: no range change
    wg = wg.reshape(n, g, group_size)
    if symmetric:
        idx = wg.abs().argmax(dim=2, keepdim=True)
        peak = torch.gather(wg, 2, idx).squeeze(2)
        scale = -peak / 8.0
        safe = torch.where(scale != 0, scale, torch.ones_like(scale))
        mins = -8.0 * scale
        q = torch.clamp(torch.round(wg / safe[..., None]) + 8, 0, 15)
    else:
        lo, hi = wg.amin(dim=2), wg.amax(dim=2)
        scale = (hi - lo) / 15.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        mins = lo
        q = torch.clamp(torch.round((wg - lo[..., None]) / safe[..., None]), 0, 15)
    q = q.reshape(n, g * group_size)[:, :k].to(torch.uint8)
    return pack_int4(q, scale, mins, group_size)


# ---------------------------------------------------------------------------
# Fake kernel, ATen reference, lazy CPU kernel
# ---------------------------------------------------------------------------
@torch.library.register_fake("fxc::linear_w4", lib=_lib)
def _linear_w4_fake(x, w_int4_packed, scales, mins, bias, n, group_size):
    k = x.shape[-1]
    torch._check(x.dtype in (torch.float32, torch.bfloat16), lambda: f"fxc::linear_w4: x dtype {x.dtype}")
    torch._check(w_int4_packed.dtype == torch.uint8 and w_int4_packed.dim() == 3 and w_int4_packed.shape[2] == NB,
                 lambda: f"fxc::linear_w4: packed weight must be uint8 [P, K/2, 32], got {tuple(w_int4_packed.shape)}")
    torch._check(w_int4_packed.shape[1] * 2 == k, lambda: f"fxc::linear_w4: K mismatch (x has K={k})")
    torch._check(n <= w_int4_packed.shape[0] * NB, lambda: f"fxc::linear_w4: n={n} larger than the packed panels")
    torch._check(scales.dtype == mins.dtype and scales.dtype in (torch.float32, torch.float16),
                 lambda: f"fxc::linear_w4: scales and mins must both be float32 or both float16, got {scales.dtype} "
                         f"and {mins.dtype}")
    return x.new_empty(tuple(x.shape[:-1]) + (n,))


def linear_w4_reference(x, w_int4_packed, scales, mins, bias, n, group_size):
    """ATen implementation of ``fxc::linear_w4``: dequantise exactly, then an fp32 matmul."""
    w = dequantize_linear_weight_int4(w_int4_packed, scales, mins, n, group_size).to(x.device)
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)


@torch.library.register_fake("fxc::linear_w4_add", lib=_lib)
def _linear_w4_add_fake(x, w_int4_packed, scales, mins, bias, residual, n, group_size):
    y = _linear_w4_fake(x, w_int4_packed, scales, mins, bias, n, group_size)
    return check_residual("fxc::linear_w4_add", y, residual)


@torch.library.register_fake("fxc::linear_w4_silu_mul", lib=_lib)
def _linear_w4_silu_mul_fake(x, w_int4_packed, scales, mins, bias, n, group_size):
    y = _linear_w4_fake(x, w_int4_packed, scales, mins, bias, n, group_size)
    return silu_mul_out("fxc::linear_w4_silu_mul", n, NB, y)


def linear_w4_add_reference(x, w_int4_packed, scales, mins, bias, residual, n, group_size):
    """``residual + fxc::linear_w4(x, ...)``: the graph ``fxc::linear_w4_add`` replaces."""
    return residual + torch.ops.fxc.linear_w4.default(x, w_int4_packed, scales, mins, bias, n, group_size)


def linear_w4_add_aten(x, w_int4_packed, scales, mins, bias, residual, n, group_size):
    """``fxc::linear_w4_add`` in ATen ops only (edf)."""
    return residual + linear_w4_reference(x, w_int4_packed, scales, mins, bias, n, group_size)


def linear_w4_silu_mul_reference(x, w_int4_packed, scales, mins, bias, n, group_size):
    """``fxc::silu_mul`` of the halves of ``fxc::linear_w4(x, ...)``: the graph ``fxc::linear_w4_silu_mul`` replaces."""
    check_silu_mul_width(n, "fxc::linear_w4_silu_mul")
    y = torch.ops.fxc.linear_w4.default(x, w_int4_packed, scales, mins, bias, n, group_size)
    return torch.ops.fxc.silu_mul.default(y[..., : n // 2], y[..., n // 2:])


def linear_w4_silu_mul_aten(x, w_int4_packed, scales, mins, bias, n, group_size):
    """``fxc::linear_w4_silu_mul`` in ATen ops only (edf)."""
    check_silu_mul_width(n, "fxc::linear_w4_silu_mul")
    y = linear_w4_reference(x, w_int4_packed, scales, mins, bias, n, group_size)
    return silu_mul_reference(y[..., : n // 2], y[..., n // 2:])


_loader: Callable[[], bool] | None = None


def set_quant_kernel_loader(loader: Callable[[], bool] | None) -> None:
    """Install a backend's ``loader() -> bool`` (True: CPU kernels for ``fxc::linear_w4`` and ``fxc::linear_f8``
    are now registered)."""
    global _loader
    _loader = loader


def _composite_of(op, reference):
    return _composite(op, reference, lambda: _loader)  # fxc::linear's re-dispatch, with this module's loader


_lib.impl("linear_w4", _composite_of(torch.ops.fxc.linear_w4.default, linear_w4_reference), "CompositeExplicitAutograd")
linear_w4 = torch.ops.fxc.linear_w4.default
_lib.impl("linear_w4_add", _composite_of(torch.ops.fxc.linear_w4_add.default, linear_w4_add_reference),
          "CompositeExplicitAutograd")
_lib.impl("linear_w4_silu_mul", _composite_of(torch.ops.fxc.linear_w4_silu_mul.default, linear_w4_silu_mul_reference),
          "CompositeExplicitAutograd")
linear_w4_add = torch.ops.fxc.linear_w4_add.default
linear_w4_silu_mul = torch.ops.fxc.linear_w4_silu_mul.default


# ---------------------------------------------------------------------------
# fxc::linear_f8: fp8 (e4m3) weight-only, one scale per output channel
# ---------------------------------------------------------------------------
_lib.define("linear_f8(Tensor x, Tensor w_f8_packed, Tensor scales, Tensor? bias, int n) -> Tensor")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def quantize_fp8_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes float8_e4m3fn [N, K], scales float32 [N, 1])`` of a ``[N, K]`` weight: ``s = amax / 448`` per
    output channel (1 for an all-zero row), ``q = fp8(w / s)`` rounded to nearest even (torch's cast).

    Error per value: ``|w − s·q| ≤ max(|w| / 16, s / 1024)`` (half an e4m3 ulp: 2^-4 relative for normals,
    2^-10 absolute for the subnormals below 2^-6)."""
    if w.dim() != 2:
        raise ValueError(f"expected a [N, K] weight, got shape {tuple(w.shape)}")
    w = w.detach().to(device="cpu", dtype=torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("fp8 quantization: the weight has non-finite values")
    amax = w.abs().amax(dim=1, keepdim=True) if w.shape[1] else w.new_zeros(w.shape[0], 1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = torch.clamp(w / scale, -FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def pack_fp8(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack fp8 codes ``[N, K]`` and per-channel scales (``[N]`` or ``[N, 1]``) for ``fxc::linear_f8``:
    ``(float8_e4m3fn [P, K, 32], float32 [P*32])``, tails zero padded."""
    if q.dim() != 2 or q.dtype != FP8:
        raise ValueError(f"expected float8_e4m3fn [N, K] codes, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    s = scales.reshape(-1).to(torch.float32)
    if s.numel() != n:
        raise ValueError(f"fp8 scales must be one per output channel ([N={n}] or [N, 1]), got {tuple(scales.shape)}")
    p = _panels(n)
    # float8 has no cat/zeros on every build: pad through its bytes
    raw = _pad_rows(q.view(torch.uint8), p * NB).reshape(p, NB, k).permute(0, 2, 1).contiguous()
    return raw.view(FP8), _pad_rows(s, p * NB).contiguous()


def quantize_linear_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 weight-only quantization of a ``[N, K]`` weight (:func:`quantize_fp8_codes`), packed for
    ``fxc::linear_f8``. Returns ``(packed_fp8, scales)``."""
    return pack_fp8(*quantize_fp8_codes(w))


def unpack_fp8(packed: torch.Tensor, scales: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_fp8`: ``(codes float8_e4m3fn [n, K], scales float32 [n])``."""
    p, k, nb = packed.shape
    q = packed.view(torch.uint8).permute(0, 2, 1).reshape(p * nb, k)[:n].contiguous().view(FP8)
    return q, scales[:n]


def dequantize_linear_weight_fp8(packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """The fp32 ``[n, K]`` weight ``fxc::linear_f8`` multiplies by: ``s·float(q)`` (the upcast is exact)."""
    q, s = unpack_fp8(packed, scales, n)
    return q.to(torch.float32) * s[:, None]


@torch.library.register_fake("fxc::linear_f8", lib=_lib)
def _linear_f8_fake(x, w_f8_packed, scales, bias, n):
    k = x.shape[-1]
    torch._check(x.dtype in (torch.float32, torch.bfloat16), lambda: f"fxc::linear_f8: x dtype {x.dtype}")
    torch._check(w_f8_packed.dtype == FP8 and w_f8_packed.dim() == 3 and w_f8_packed.shape[2] == NB,
                 lambda: f"fxc::linear_f8: packed weight must be float8_e4m3fn [P, K, 32], got "
                         f"{w_f8_packed.dtype} {tuple(w_f8_packed.shape)}")
    torch._check(w_f8_packed.shape[1] == k, lambda: f"fxc::linear_f8: K mismatch (x has K={k})")
    torch._check(scales.dim() == 1 and scales.shape[0] == w_f8_packed.shape[0] * NB,
                 lambda: "fxc::linear_f8: scales must be float32 [P*32]")
    torch._check(n <= w_f8_packed.shape[0] * NB, lambda: f"fxc::linear_f8: n={n} larger than the packed panels")
    return x.new_empty(tuple(x.shape[:-1]) + (n,))


def linear_f8_reference(x, w_f8_packed, scales, bias, n):
    """ATen implementation of ``fxc::linear_f8``: upcast the fp8 codes, scale, then an fp32 matmul."""
    w = dequantize_linear_weight_fp8(w_f8_packed, scales, n).to(x.device)
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)


_lib.impl("linear_f8", _composite_of(torch.ops.fxc.linear_f8.default, linear_f8_reference), "CompositeExplicitAutograd")
linear_f8 = torch.ops.fxc.linear_f8.default
