"""``fxc::linear_w8a8``: W8A8, dynamic per-token int8 activations times per-channel int8 weights.

IR level (importable by passes and backends): schema, fake kernel, ATen reference and the pure PyTorch
packer. The CPU kernel (AVX-512 VNNI, AVX-VNNI, AVX2, scalar) is ``backends/cpu/csrc/w8a8_kernels.cpp``.

``fxc::linear_w8a8(Tensor x, Tensor w_int8_packed, Tensor w_scale, Tensor w_sums, Tensor? bias, int n) -> Tensor``
    x ``[..., K]`` fp32 or bf16; returns ``[..., n]`` in x's dtype.

Value (what the reference and every kernel path compute, bit for bit):

* per row ``r`` of x (a token): ``amax_r = max_k |x[r, k]|``, ``x_scale_r = amax_r / 127`` and
  ``qx[r, k] = clamp(round_half_even(x[r, k] · (127 / amax_r)), −127, 127)`` (all fp32; a zero row gives 0);
* ``acc[r, n] = Σ_k qx[r, k] · q[n, k]`` exactly in int32 (|acc| ≤ K·127², so K < 133 000);
* ``out[r, n] = fl(fl(float(acc) · x_scale_r) · w_scale[n]) (+ bias[n])``, then rounded to x's dtype.

Layout (``NB = 32`` output columns per panel, ``P = ceil(N / 32)``, ``K4 = ceil(K / 4)``, tails zero padded):

* ``w_int8_packed``: ``int8 [P, K4, 32, 4]``, ``packed[p, i, j, t] = q[32p + j, 4i + t]`` in [−127, 127]:
  each 32-bit lane holds 4 consecutive k of one column, what ``vpdpbusd`` / ``pmaddubsw`` read;
* ``w_scale``: ``float32 [P*32]`` (``amax / 127`` per output channel), ``w_sums``: ``int32 [P*32]``,
  ``Σ_k q[n, k]``: the VNNI kernels add 128 to the activations (``vpdpbusd`` multiplies unsigned by signed
  bytes) and subtract ``128 · w_sums`` once per output.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .linear import NB, _composite, _pad_rows, _panels

__all__ = ["QMAX", "dequantize_w8a8_weight", "linear_w8a8", "linear_w8a8_reference", "pack_w8a8",
           "quantize_activations_per_token", "quantize_w8a8_weight", "set_w8a8_kernel_loader", "unpack_w8a8"]

QMAX = 127
_lib = torch.library.Library("fxc", "FRAGMENT")
_lib.define("linear_w8a8(Tensor x, Tensor w_int8_packed, Tensor w_scale, Tensor w_sums, Tensor? bias, int n) -> Tensor")


def quantize_w8a8_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8 [N, K] in [−127, 127], scales float32 [N])`` of a ``[N, K]`` weight, ``s = amax / 127``
    per output channel (1 for an all-zero row), ``q = round(w / s)``."""
    if w.dim() != 2:
        raise ValueError(f"expected a [N, K] weight, got shape {tuple(w.shape)}")
    w = w.detach().to(device="cpu", dtype=torch.float32)
    amax = w.abs().amax(dim=1) if w.shape[1] else w.new_zeros(w.shape[0])
    s = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    return torch.clamp(torch.round(w / s[:, None]), -QMAX, QMAX).to(torch.int8), s


def pack_w8a8(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack int8 codes ``[N, K]`` (in [−127, 127]) and per-channel scales (``[N]`` or ``[N, 1]``) for
    ``fxc::linear_w8a8``: ``(int8 [P, K4, 32, 4], float32 [P*32], int32 [P*32] column sums)``."""
    if q.dim() != 2 or q.dtype != torch.int8:
        raise ValueError(f"w8a8 codes must be int8 [N, K], got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    s = scales.reshape(-1).to(torch.float32)
    if s.numel() != n:
        raise ValueError(f"w8a8 scales must be one per output channel ([N={n}] or [N, 1]), got {tuple(scales.shape)}")
    if q.numel() and int(q.min()) < -QMAX:
        raise ValueError("w8a8 codes must be in [-127, 127] (-128 has no negation for the AVX2 sign trick)")
    p, k4 = _panels(n), -(-k // 4)
    qp = _pad_rows(q, p * NB)
    if k4 * 4 != k:
        qp = torch.cat([qp, qp.new_zeros(p * NB, k4 * 4 - k)], 1)
    packed = qp.reshape(p, NB, k4, 4).permute(0, 2, 1, 3).contiguous()
    sums = qp.to(torch.int32).sum(1, dtype=torch.int32).contiguous()
    return packed, _pad_rows(s, p * NB).contiguous(), sums


def quantize_w8a8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RTN of a ``[N, K]`` weight (:func:`quantize_w8a8_codes`), packed (:func:`pack_w8a8`)."""
    return pack_w8a8(*quantize_w8a8_codes(w))


def unpack_w8a8(packed: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_w8a8`: ``(codes int8 [n, k], scales float32 [n])``."""
    p, k4, nb, four = packed.shape
    q = packed.permute(0, 2, 1, 3).reshape(p * nb, k4 * four)[:n, :k].contiguous()
    return q, scales[:n]


def dequantize_w8a8_weight(packed: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The fp32 ``[n, k]`` weight ``s·q`` (what the op multiplies the quantized activations by)."""
    q, s = unpack_w8a8(packed, scales, n, k)
    return q.to(torch.float32) * s[:, None]


def quantize_activations_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qx int8 [M, K], x_scale float32 [M])`` of a ``[M, K]`` fp32 tensor, the op's activation rule."""
    x = x.to(torch.float32)
    amax = x.abs().amax(dim=1) if x.shape[1] else x.new_zeros(x.shape[0])
    pos = amax > 0
    # a true division (``127 / tensor`` is ``reciprocal() * 127`` in torch: rounded twice)
    inv = torch.where(pos, torch.full_like(amax, QMAX) / torch.where(pos, amax, torch.ones_like(amax)),
                      torch.zeros_like(amax))
    qx = torch.clamp(torch.round(x * inv[:, None]), -QMAX, QMAX).to(torch.int8)
    return qx, amax / QMAX


def _int_matmul(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """Exact ``a [M, K] @ b_t [N, K].T`` in int32 (``torch._int_mm`` where its shape rules allow)."""
    m, k = a.shape
    if m > 16 and k % 8 == 0 and b_t.shape[0] % 8 == 0 and hasattr(torch, "_int_mm"):
        try:
            return torch._int_mm(a, b_t.t())
        except RuntimeError:
            pass
    return torch.mm(a.to(torch.int32), b_t.to(torch.int32).t())


def linear_w8a8_reference(x, w_int8_packed, w_scale, w_sums, bias, n):
    """ATen implementation of ``fxc::linear_w8a8`` (the value definition in the module docstring)."""
    k = x.shape[-1]
    x2 = x.reshape(math.prod(x.shape[:-1]), k).to(torch.float32)
    qx, xs = quantize_activations_per_token(x2)
    q, ws = unpack_w8a8(w_int8_packed, w_scale, n, k)
    acc = _int_matmul(qx.cpu(), q.cpu()).to(x.device)
    out = (acc.to(torch.float32) * xs[:, None].to(x.device)) * ws[None, :].to(x.device)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.reshape(tuple(x.shape[:-1]) + (n,)).to(x.dtype)


@torch.library.register_fake("fxc::linear_w8a8", lib=_lib)
def _linear_w8a8_fake(x, w_int8_packed, w_scale, w_sums, bias, n):
    k = x.shape[-1]
    torch._check(x.dtype in (torch.float32, torch.bfloat16), lambda: f"fxc::linear_w8a8: x dtype {x.dtype}")
    torch._check(w_int8_packed.dtype == torch.int8 and w_int8_packed.dim() == 4 and w_int8_packed.shape[2] == NB
                 and w_int8_packed.shape[3] == 4,
                 lambda: f"fxc::linear_w8a8: packed weight must be int8 [P, K4, 32, 4], got {tuple(w_int8_packed.shape)}")
    torch._check(w_int8_packed.shape[1] == (k + 3) // 4, lambda: f"fxc::linear_w8a8: K mismatch (x has K={k})")
    torch._check(w_scale.dim() == 1 and w_scale.shape[0] == w_int8_packed.shape[0] * NB,
                 lambda: "fxc::linear_w8a8: w_scale must be float32 [P*32]")
    torch._check(w_sums.dim() == 1 and w_sums.shape[0] == w_int8_packed.shape[0] * NB,
                 lambda: "fxc::linear_w8a8: w_sums must be int32 [P*32]")
    torch._check(n <= w_int8_packed.shape[0] * NB, lambda: f"fxc::linear_w8a8: n={n} larger than the packed panels")
    return x.new_empty(tuple(x.shape[:-1]) + (n,))


_loader: Callable[[], bool] | None = None


def set_w8a8_kernel_loader(loader: Callable[[], bool] | None) -> None:
    """Install a backend's ``loader() -> bool`` (True: a CPU kernel for ``fxc::linear_w8a8`` is registered)."""
    global _loader
    _loader = loader


_lib.impl("linear_w8a8", _composite(torch.ops.fxc.linear_w8a8.default, linear_w8a8_reference, lambda: _loader),
          "CompositeExplicitAutograd")
linear_w8a8 = torch.ops.fxc.linear_w8a8.default
