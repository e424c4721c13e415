"""``fxc::embedding_w8`` / ``fxc::embedding_w4``: an embedding lookup that dequantises only the gathered rows.

IR level (importable by passes and backends): schemas, fake kernels and the ATen implementations (the CPU
kernels, one pass over the gathered rows, are in ``backends/cpu/csrc/quant_kernels.cpp``, loaded with
``fxc::linear_w4``'s; they equal these references bit for bit). The
``quantize`` pass uses them for a GGUF's quantized ``token_embd`` (``keep_gguf_quantization``), so the
table stays in the checkpoint's blocks (Q8_0: 1.125 bytes a value with fp32 scales) instead of an fp32 copy.

The tables use the weight layouts of ``fxc::linear_w8`` / ``fxc::linear_w4`` (``NB = 32`` rows a panel), so a
tied output projection quantized from the same blocks and the lookup read one set of tensors:

``fxc::embedding_w8(Tensor ids, Tensor w_int8_packed, Tensor scales, int n, int group_size) -> Tensor``
    ``w_int8_packed`` int8 ``[P, K, 32]``; ``scales`` fp32 ``[P*32]`` (``group_size`` -1) or ``[P, G, 32]``;
    row ``r`` is ``w[r, k] = scales[g, r] · q[r, k]``, ``g = k // group_size`` (``fxc::linear_w8``'s value).
``fxc::embedding_w4(Tensor ids, Tensor w_int4_packed, Tensor scales, Tensor mins, int n, int group_size) -> Tensor``
    ``w_int4_packed`` uint8 ``[P, K/2, 32]``; ``scales``/``mins`` ``[P, G, 32]`` fp32 or fp16;
    ``w[r, k] = fl(fl(scales[g, r] · q[r, k]) + mins[g, r])`` (``fxc::linear_w4``'s value).

``n`` is the table's row count (the last panel is zero padded). Both return float32 ``[*ids.shape, K]``: the
rows bit for bit as the linear op's dequantisation gives them (for GGUF blocks: gguf-py's and transformers'
fp32 tensors). Ids out of ``[0, n)`` raise ``IndexError`` as ``aten.embedding`` does (checked outside
tracing only: AOTInductor compiles the references).
"""
from __future__ import annotations

import torch

from . import quant_linear
from .linear import NB, _composite
from .quant_linear import dequantize_int4_codes

__all__ = ["embedding_w4", "embedding_w4_reference", "embedding_w8", "embedding_w8_reference"]

_lib = torch.library.Library("fxc", "FRAGMENT")
_lib.define("embedding_w8(Tensor ids, Tensor w_int8_packed, Tensor scales, int n, int group_size) -> Tensor")
_lib.define("embedding_w4(Tensor ids, Tensor w_int4_packed, Tensor scales, Tensor mins, int n, int group_size) -> Tensor")


def _rows(ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = ids.reshape(-1).long()
    if not torch.compiler.is_compiling() and flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise IndexError(f"embedding: index out of range (ids in [{int(flat.min())}, {int(flat.max())}], "
                         f"table of {n} rows)")
    return flat // NB, flat % NB


def _group_index(k: int, group_size: int, device) -> torch.Tensor:
    return torch.arange(k, device=device) // group_size


def embedding_w8_reference(ids, w_int8_packed, scales, n, group_size):
    """The fp32 rows ``ids`` of an ``fxc::linear_w8`` table (only those rows are read and dequantised)."""
    k = w_int8_packed.shape[1]
    p, j = _rows(ids, n)
    q = w_int8_packed[p, :, j].to(torch.float32)  # [T, K]
    if scales.dim() == 1:
        w = q * scales[p * NB + j].to(torch.float32)[:, None]
    else:
        s = scales[p, :, j].to(torch.float32)  # [T, G]
        w = q * s[:, _group_index(k, group_size, q.device)]
    return w.reshape(*ids.shape, k)


def embedding_w4_reference(ids, w_int4_packed, scales, mins, n, group_size):
    """The fp32 rows ``ids`` of an ``fxc::linear_w4`` table: ``fl(fl(s·q) + m)`` per value."""
    half = w_int4_packed.shape[1]
    p, j = _rows(ids, n)
    b = w_int4_packed[p, :, j]  # [T, K/2]
    q = torch.stack([b & 0x0F, b >> 4], dim=2).reshape(b.shape[0], 2 * half)
    w = dequantize_int4_codes(q, scales[p, :, j], mins[p, :, j], group_size)  # the linear op's value definition
    return w.reshape(*ids.shape, 2 * half)


@torch.library.register_fake("fxc::embedding_w8", lib=_lib)
def _embedding_w8_fake(ids, w_int8_packed, scales, n, group_size):
    torch._check(w_int8_packed.dtype == torch.int8 and w_int8_packed.dim() == 3 and w_int8_packed.shape[2] == NB,
                 lambda: f"fxc::embedding_w8: table must be int8 [P, K, 32], got {tuple(w_int8_packed.shape)}")
    return w_int8_packed.new_empty(tuple(ids.shape) + (w_int8_packed.shape[1],), dtype=torch.float32)


@torch.library.register_fake("fxc::embedding_w4", lib=_lib)
def _embedding_w4_fake(ids, w_int4_packed, scales, mins, n, group_size):
    torch._check(w_int4_packed.dtype == torch.uint8 and w_int4_packed.dim() == 3 and w_int4_packed.shape[2] == NB,
                 lambda: f"fxc::embedding_w4: table must be uint8 [P, K/2, 32], got {tuple(w_int4_packed.shape)}")
    return w_int4_packed.new_empty(tuple(ids.shape) + (2 * w_int4_packed.shape[1],), dtype=torch.float32)


# The references, until the quantized-kernel library (backends/cpu/csrc/quant_kernels.cpp, loaded with
# fxc::linear_w4's loader) registers the C++ lookups for CPU tensors: the same values, bit for bit.
_lib.impl("embedding_w8", _composite(torch.ops.fxc.embedding_w8.default, embedding_w8_reference,
                                     lambda: quant_linear._loader), "CompositeExplicitAutograd")
_lib.impl("embedding_w4", _composite(torch.ops.fxc.embedding_w4.default, embedding_w4_reference,
                                     lambda: quant_linear._loader), "CompositeExplicitAutograd")

embedding_w8 = torch.ops.fxc.embedding_w8.default
embedding_w4 = torch.ops.fxc.embedding_w4.default
