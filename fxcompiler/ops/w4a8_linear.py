"""``fxc::linear_w4a8``: W4A8, int4 weights (a scale and a min per group) times int8 activations quantized per
row and weight group at run time: llama.cpp's Q4_1 × Q8_1 numerics, on ``fxc::linear_w4``'s weight values.

IR level (importable by passes and backends): schema, fake kernel, ATen reference and the pure PyTorch
packers. The CPU kernel (AVX-512 VNNI, AVX-VNNI, AVX2 ``vpmaddubsw``, scalar) is in
``backends/cpu/csrc/w8a8_kernels.cpp`` beside W8A8's, whose path switch it shares.

``fxc::linear_w4a8(Tensor x, Tensor w_int4_packed, Tensor scales, Tensor mins, Tensor? bias, int n, int group_size) -> Tensor``
    x ``[..., K]`` fp32 or bf16; returns ``[..., n]`` in x's dtype.

Value (what the reference and every kernel path compute, bit for bit):

* weights: ``w[n, k] = s[g, n]·q[n, k] + m[g, n]``, ``q`` in [0, 15], ``g = k // group_size`` — the values
  ``fxc::linear_w4`` dequantises to (GGUF Q4_0/Q4_1 blocks repack exactly);
* activations, per row ``r`` and group ``g`` (fp32): ``amax``, ``dx = amax / 127``,
  ``qx = clamp(round_half_even(x · (127 / amax)), −127, 127)`` (0 for a zero group), ``xs = Σ x`` summed in k
  order;
* ``out[r, n] = Σ_g (float(Σ_k q·qx)·fl(s·dx) + m·xs)`` (+ bias), accumulated over g in ascending order, each
  product and sum rounded to fp32: the integer sums are exact, the min term uses the unquantized sum of x
  (llama.cpp's Q8_1 stores the sum of its quantized values instead).

Error against the float product ``x @ w.T``: the activation rounding only, at most ``dx/2`` per element, i.e.
``|Δ| ≤ Σ_g (dx_g / 2)·Σ_{k∈g} |s·q|`` (documented bound, :func:`error_bound`).

Layout (``NB4 = 16`` output columns a panel, ``P = ceil(N / 16)``, ``G = ceil(K / group_size)``, ``K`` and
``group_size`` multiples of 8, tail columns zero padded):

* ``w_int4_packed``: ``uint8 [P, K/8, 16, 4]``, ``byte[p, c, j, t] = q[16p+j, 8c+t] | q[16p+j, 8c+4+t] << 4``:
  a 64-byte row holds 8 k of 16 columns, each column's 4 consecutive k in one dword (what ``vpdpbusd`` reads);
* ``scales``, ``mins``: ``[P, G, 16]``, both float32 or both float16 (fp16 when every value is one: GGUF's).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .linear import _composite, _pad_rows, check_residual, silu_mul_out
from .quant_linear import dequantize_int4_codes, group_params_layout, unpack_int4

__all__ = ["NB4", "error_bound", "linear_w4a8", "linear_w4a8_add", "linear_w4a8_add_reference", "linear_w4a8_reference",
           "linear_w4a8_silu_mul",
           "linear_w4a8_silu_mul_reference", "pack_w4a8", "quantize_activations_per_group",
           "repack_w4_as_w4a8", "set_w4a8_kernel_loader", "unpack_w4a8"]

NB4 = 16
QMAX = 127
MAX_GROUP = 1 << 17  # longest group (min(K, group_size)) the kernels' int32 sums hold
_lib = torch.library.Library("fxc", "FRAGMENT")
_lib.define("linear_w4a8(Tensor x, Tensor w_int4_packed, Tensor scales, Tensor mins, Tensor? bias, int n, "
            "int group_size) -> Tensor")


def check_shape(k: int, group_size: int) -> None:
    """W4A8 needs ``K`` and ``group_size`` multiples of 8 (8 k a packed 64-byte row) and groups of at most
    ``MAX_GROUP`` k (the kernel's int32 group sums); raises ``ValueError``."""
    if group_size <= 0 or group_size % 8 or k % 8:
        raise ValueError(f"W4A8 (fxc::linear_w4a8) needs K and group_size multiples of 8, got K={k}, "
                         f"group_size={group_size}")
    if min(k, group_size) > MAX_GROUP:
        raise ValueError(f"W4A8 (fxc::linear_w4a8) needs groups of at most {MAX_GROUP} k (the int32 group sums "
                         f"could overflow), got K={k}, group_size={group_size}")


def pack_w4a8(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int, compact: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack codes ``q`` (uint8 ``[N, K]`` in [0, 15]) with ``scales``/``mins`` (``[N, G]``) for ``fxc::linear_w4a8``.
    ``compact``: scales and mins in float16 when all are fp16 values (no weight changes)."""
    if q.dim() != 2:
        raise ValueError(f"expected [N, K] int4 codes, got shape {tuple(q.shape)}")
    n, k = q.shape
    check_shape(k, group_size)
    g = -(-k // group_size)
    if tuple(scales.shape) != (n, g) or tuple(mins.shape) != (n, g):
        raise ValueError(f"scales and mins must be [N={n}, G={g}], got {tuple(scales.shape)} and {tuple(mins.shape)}")
    q = q.to(torch.uint8)
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"int4 codes must be in [0, 15], got a maximum of {int(q.max())}")
    p = -(-n // NB4)
    qp = _pad_rows(q, p * NB4).reshape(p, NB4, k // 8, 2, 4)  # [P, 16, K/8, lo/hi half, 4]
    packed = (qp[..., 0, :] | (qp[..., 1, :] << 4)).permute(0, 2, 1, 3).contiguous()  # [P, K/8, 16, 4]

    return (packed, *group_params_layout(scales, mins, p, NB4, compact))


def unpack_w4a8(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, n: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_w4a8`: ``(q [n, K] uint8, scales [n, G], mins [n, G])`` (scales/mins as stored)."""
    p, k8, nb, four = packed.shape
    t = packed.permute(0, 2, 1, 3)  # [P, 16, K/8, 4]
    q = torch.stack([t & 0x0F, t >> 4], dim=3).reshape(p * nb, k8 * 8)[:n]
    g = scales.shape[1]
    return q, scales.permute(0, 2, 1).reshape(p * nb, g)[:n], mins.permute(0, 2, 1).reshape(p * nb, g)[:n]


def repack_w4_as_w4a8(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, n: int, group_size: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fxc::linear_w4``'s packed weight in ``fxc::linear_w4a8``'s layout (same codes, scales and mins)."""
    q, s, m = unpack_int4(packed, scales, mins, n)
    compact = scales.dtype == torch.float16
    return pack_w4a8(q, s.float(), m.float(), group_size, compact=compact)


def quantize_activations_per_group(x: torch.Tensor, group_size: int
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qx int8 [M, K], dx float32 [M, G], xs float32 [M, G])`` of a ``[M, K]`` tensor, the op's activation rule."""
    x = x.to(torch.float32)
    m, k = x.shape
    g = -(-k // group_size)
    pad = g * group_size - k
    xg = torch.cat([x, x.new_zeros(m, pad)], 1).reshape(m, g, group_size) if pad else x.reshape(m, g, group_size)
    amax = xg.abs().amax(dim=2)
    pos = amax > 0
    inv = torch.where(pos, torch.full_like(amax, QMAX) / torch.where(pos, amax, torch.ones_like(amax)),
                      torch.zeros_like(amax))  # a true division, as the kernel's 127.0f / amax
    qx = torch.clamp(torch.round(xg * inv[..., None]), -QMAX, QMAX).to(torch.int8).reshape(m, g * group_size)[:, :k]
    xs = xg[..., 0].clone()
    for j in range(1, group_size):  # in k order, as the kernel (a padded tail adds zeros: exact)
        xs = xs + xg[..., j]
    return qx.contiguous(), amax / QMAX, xs


def linear_w4a8_reference(x, w_int4_packed, scales, mins, bias, n, group_size):
    """ATen implementation of ``fxc::linear_w4a8`` (the value definition in the module docstring)."""
    k = x.shape[-1]
    x2 = x.reshape(math.prod(x.shape[:-1]), k).to(torch.float32).cpu()
    qx, dx, xs = quantize_activations_per_group(x2, group_size)
    q, s, m = unpack_w4a8(w_int4_packed.cpu(), scales.cpu(), mins.cpu(), n)
    s, m = s.float(), m.float()
    out = torch.zeros(x2.shape[0], n)
    for g in range(dx.shape[1]):
        k0, k1 = g * group_size, min(k, (g + 1) * group_size)
        isum = (qx[:, k0:k1].double() @ q[:, k0:k1].double().t()).float()  # exact: |Σ| < 2^24
        out = (out + isum * (s[None, :, g] * dx[:, g, None])) + m[None, :, g] * xs[:, g, None]
    if bias is not None:
        out = out + bias.float().cpu()
    return out.reshape(tuple(x.shape[:-1]) + (n,)).to(device=x.device, dtype=x.dtype)


def error_bound(x: torch.Tensor, w_int4_packed, scales, mins, n: int, group_size: int) -> torch.Tensor:
    """Per-output bound on ``|linear_w4a8 − x @ w.T|`` from the activation rounding (``dx/2`` per element),
    ``[M, n]``; the fp32 sums add a few ulps of ``Σ|x·w|`` on top."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float()
    _, dx, _ = quantize_activations_per_group(x2, group_size)
    q, s, m = unpack_w4a8(w_int4_packed, scales, mins, n)
    sq = (q.float() * s.float()[:, torch.arange(k) // group_size]).abs()  # |s·q|, the part the codes multiply
    bound = torch.zeros(x2.shape[0], n)
    for g in range(dx.shape[1]):
        k0, k1 = g * group_size, min(k, (g + 1) * group_size)
        bound += (dx[:, g, None] / 2) * sq[:, k0:k1].sum(1)[None, :]
    return bound


def dequantize_w4a8_weight(packed, scales, mins, n: int, group_size: int) -> torch.Tensor:
    """The fp32 ``[n, K]`` weight values (``fxc::linear_w4``'s)."""
    q, s, m = unpack_w4a8(packed, scales, mins, n)
    return dequantize_int4_codes(q, s, m, group_size)


@torch.library.register_fake("fxc::linear_w4a8", lib=_lib)
def _linear_w4a8_fake(x, w_int4_packed, scales, mins, bias, n, group_size):
    k = x.shape[-1]
    torch._check(x.dtype in (torch.float32, torch.bfloat16), lambda: f"fxc::linear_w4a8: x dtype {x.dtype}")
    torch._check(w_int4_packed.dtype == torch.uint8 and w_int4_packed.dim() == 4 and w_int4_packed.shape[2] == NB4
                 and w_int4_packed.shape[3] == 4,
                 lambda: f"fxc::linear_w4a8: packed weight must be uint8 [P, K/8, 16, 4], got "
                         f"{tuple(w_int4_packed.shape)}")
    torch._check(w_int4_packed.shape[1] * 8 == k, lambda: f"fxc::linear_w4a8: K mismatch (x has K={k})")
    torch._check(n <= w_int4_packed.shape[0] * NB4, lambda: f"fxc::linear_w4a8: n={n} larger than the packed panels")
    torch._check(scales.dtype == mins.dtype and scales.dtype in (torch.float32, torch.float16),
                 lambda: f"fxc::linear_w4a8: scales and mins must both be float32 or both float16, got "
                         f"{scales.dtype} and {mins.dtype}")
    return x.new_empty(tuple(x.shape[:-1]) + (n,))


_loader: Callable[[], bool] | None = None


def set_w4a8_kernel_loader(loader: Callable[[], bool] | None) -> None:
    """Install a backend's ``loader() -> bool`` (True: a CPU kernel for ``fxc::linear_w4a8`` is registered)."""
    global _loader
    _loader = loader


_lib.impl("linear_w4a8", _composite(torch.ops.fxc.linear_w4a8.default, linear_w4a8_reference, lambda: _loader),
          "CompositeExplicitAutograd")
linear_w4a8 = torch.ops.fxc.linear_w4a8.default


# ---------------------------------------------------------------------------
# fxc::linear_w4a8_silu_mul: the gated MLP's fused gate/up projection and its silu product as one op
# ---------------------------------------------------------------------------
_lib.define("linear_w4a8_silu_mul(Tensor x, Tensor w_int4_packed, Tensor scales, Tensor mins, Tensor? bias, int n, "
            "int group_size) -> Tensor")


def check_silu_mul_width(n: int) -> None:
    """``n = 2H`` with ``H`` a multiple of ``NB4``: the gate and up halves on whole panels; raises ``ValueError``."""
    if n <= 0 or n % (2 * NB4):
        raise ValueError(f"fxc::linear_w4a8_silu_mul needs n = 2 * H with H a multiple of {NB4}, got n={n}")


def linear_w4a8_silu_mul_reference(x, w_int4_packed, scales, mins, bias, n, group_size):
    """``fxc::silu_mul`` of the halves of ``fxc::linear_w4a8(x, ...)`` (``[..., n/2]``): the graph the op replaces.
    Calls the two ops, so on CPU it equals the fused kernel bit for bit (the kernels' own numerics)."""
    check_silu_mul_width(n)
    y = torch.ops.fxc.linear_w4a8.default(x, w_int4_packed, scales, mins, bias, n, group_size)
    gate, up = y.split(n // 2, dim=-1)
    return torch.ops.fxc.silu_mul.default(gate, up)


def linear_w4a8_silu_mul_aten(x, w_int4_packed, scales, mins, bias, n, group_size):
    """The same in ATen references only (edf: Inductor compiles it)."""
    from .fused import silu_mul_reference

    check_silu_mul_width(n)
    gate, up = linear_w4a8_reference(x, w_int4_packed, scales, mins, bias, n, group_size).split(n // 2, dim=-1)
    return silu_mul_reference(gate, up)


@torch.library.register_fake("fxc::linear_w4a8_silu_mul", lib=_lib)
def _linear_w4a8_silu_mul_fake(x, w_int4_packed, scales, mins, bias, n, group_size):
    y = _linear_w4a8_fake(x, w_int4_packed, scales, mins, bias, n, group_size)
    return silu_mul_out("fxc::linear_w4a8_silu_mul", n, NB4, y)


_lib.impl("linear_w4a8_silu_mul", _composite(torch.ops.fxc.linear_w4a8_silu_mul.default,
                                             linear_w4a8_silu_mul_reference, lambda: _loader),
          "CompositeExplicitAutograd")
linear_w4a8_silu_mul = torch.ops.fxc.linear_w4a8_silu_mul.default


# ---------------------------------------------------------------------------
# fxc::linear_w4a8_add: an output projection and its residual add as one op
# ---------------------------------------------------------------------------
_lib.define("linear_w4a8_add(Tensor x, Tensor w_int4_packed, Tensor scales, Tensor mins, Tensor? bias, Tensor residual, "
            "int n, int group_size) -> Tensor")


def linear_w4a8_add_reference(x, w_int4_packed, scales, mins, bias, residual, n, group_size):
    """``residual + fxc::linear_w4a8(x, ...)`` (a layer's output projection and its residual add): the graph the op
    replaces, so on CPU it equals the fused kernel bit for bit."""
    return residual + torch.ops.fxc.linear_w4a8.default(x, w_int4_packed, scales, mins, bias, n, group_size)


def linear_w4a8_add_aten(x, w_int4_packed, scales, mins, bias, residual, n, group_size):
    """The same in ATen references only (edf: Inductor compiles it)."""
    return residual + linear_w4a8_reference(x, w_int4_packed, scales, mins, bias, n, group_size)


@torch.library.register_fake("fxc::linear_w4a8_add", lib=_lib)
def _linear_w4a8_add_fake(x, w_int4_packed, scales, mins, bias, residual, n, group_size):
    y = _linear_w4a8_fake(x, w_int4_packed, scales, mins, bias, n, group_size)
    return check_residual("fxc::linear_w4a8_add", y, residual)


_lib.impl("linear_w4a8_add", _composite(torch.ops.fxc.linear_w4a8_add.default, linear_w4a8_add_reference,
                                        lambda: _loader), "CompositeExplicitAutograd")
linear_w4a8_add = torch.ops.fxc.linear_w4a8_add.default
