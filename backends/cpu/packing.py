"""Build-time weight packing for the ``fxc`` CPU ops (pure PyTorch, no C++ needed).

Layouts (``NB = 32`` output columns per panel, ``P = ceil(N / 32)``, tail zero padded):

* fp32: ``float32 [P, K, 32]`` with ``packed[p, k, j] = W[32 p + j, k]``
* bf16: ``bfloat16 [P, ceil(K/2), 32, 2]`` with ``packed[p, q, j, s] = W[32 p + j, 2 q + s]``
* int8: ``int8 [P, K, 32]`` (same as fp32) and fp32 scales, ``[P*32]`` per output
  channel or ``[P, K/group_size, 32]`` per group along K.  Symmetric, ``q = round(w / s)``
  clamped to [-127, 127], ``s = absmax / 127``.
"""

from __future__ import annotations

import torch

NB = 32  # output columns per panel


def _panels(n: int) -> int:
    return (n + NB - 1) // NB


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    pad = w.new_zeros((rows - w.shape[0],) + tuple(w.shape[1:]))
    return torch.cat([w, pad], 0)


def pack_linear_weight(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Pack a ``[N, K]`` linear weight for ``fxc::linear`` (dtype float32 or bfloat16)."""
    if w.dim() != 2:
        raise ValueError(f"expected a [N, K] weight, got shape {tuple(w.shape)}")
    dtype = w.dtype if dtype is None else dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"pack_linear_weight supports float32 and bfloat16, got {dtype}")
    w = w.detach().to(device="cpu", dtype=dtype)
    n, k = w.shape
    p = _panels(n)
    wp = _pad_rows(w, p * NB).reshape(p, NB, k)  # [P, 32, K]
    if dtype == torch.float32:
        return wp.permute(0, 2, 1).contiguous()  # [P, K, 32]
    if k % 2:
        wp = torch.cat([wp, wp.new_zeros(p, NB, 1)], 2)
    kp = wp.shape[2]
    # [P, 32, Kp/2, 2] -> [P, Kp/2, 32, 2]
    return wp.reshape(p, NB, kp // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_linear_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_linear_weight`: the ``[n, k]`` weight in the packed dtype."""
    if packed.dtype == torch.float32 and packed.dim() == 3:
        p = packed.shape[0]
        return packed.permute(0, 2, 1).reshape(p * NB, k)[:n]
    if packed.dtype == torch.bfloat16 and packed.dim() == 4:
        p, q = packed.shape[0], packed.shape[1]
        return packed.permute(0, 2, 1, 3).reshape(p * NB, 2 * q)[:n, :k]
    raise ValueError(f"not a packed fxc weight: dtype {packed.dtype}, shape {tuple(packed.shape)}")


def _is_per_channel(group_size: int | None, k: int) -> bool:
    return group_size is None or group_size <= 0 or group_size == k


def quantize_linear_weight_int8(w: torch.Tensor, group_size: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 weight-only quantization of a ``[N, K]`` weight, packed for ``fxc::linear_w8``.

    ``group_size`` -1 (or K) gives one scale per output channel; otherwise K must be a
    multiple of ``group_size`` (32, 64, 128 are the intended values) and there is one
    scale per output channel per group of ``group_size`` along K.
    Returns ``(packed_int8, scales)``.
    """
    if w.dim() != 2:
        raise ValueError(f"expected a [N, K] weight, got shape {tuple(w.shape)}")
    w = w.detach().to(device="cpu", dtype=torch.float32)
    n, k = w.shape
    p = _panels(n)
    if _is_per_channel(group_size, k):
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
        scales = _pad_rows(scale, p * NB).contiguous()
    else:
        if k % group_size:
            raise ValueError(f"group_size {group_size} must divide K={k}")
        g = k // group_size
        wg = w.reshape(n, g, group_size)
        amax = wg.abs().amax(dim=2)  # [N, G]
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q = torch.clamp(torch.round(wg / scale[:, :, None]), -127, 127).to(torch.int8).reshape(n, k)
        scales = _pad_rows(scale, p * NB).reshape(p, NB, g).permute(0, 2, 1).contiguous()  # [P, G, 32]
    packed = _pad_rows(q, p * NB).reshape(p, NB, k).permute(0, 2, 1).contiguous()  # [P, K, 32]
    return packed, scales


def dequantize_linear_weight_int8(packed: torch.Tensor, scales: torch.Tensor, n: int, group_size: int = -1
                                  ) -> torch.Tensor:
    """The fp32 ``[n, K]`` weight that ``fxc::linear_w8`` multiplies by (reference / fallback)."""
    p, k, nb = packed.shape
    q = packed.permute(0, 2, 1).reshape(p * nb, k).float()
    if scales.dim() == 1:
        w = q * scales[:, None]
    else:
        g = scales.shape[1]
        s = scales.permute(0, 2, 1).reshape(p * nb, g)
        w = (q.reshape(p * nb, g, k // g) * s[:, :, None]).reshape(p * nb, k)
    return w[:n]
