"""GGUF quantized tensors read natively (no dequantisation): Q4_0, Q4_1 → int4 codes + scale + min,
Q8_0 → int8 codes + scale, with the q/k row permutation of llama.cpp's converter undone.

Block layouts (ggml ``QK = 32`` values per block, little-endian, as in ggml-common.h / gguf-py):

* Q4_0, 18 bytes: ``d`` fp16, ``qs[16]``; value ``j`` (0..15) is ``qs[j] & 0xF``, value ``j + 16`` is
  ``qs[j] >> 4``; ``x = d · (q − 8)``.
* Q4_1, 20 bytes: ``d`` fp16, ``m`` fp16, ``qs[16]`` as Q4_0; ``x = d · q + m``.
* Q8_0, 34 bytes: ``d`` fp16, ``qs[32]`` int8; ``x = d · q``.

llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of ``attn_q`` / ``attn_k`` of llama-family
models (rotary halves interleaved); transformers undoes it on load (``_reverse_permute_weights``).
Blocks run along K (a row), so the row permutation moves whole rows of blocks: :func:`read_native`
applies the same inverse permutation to the codes, scales and mins, exactly.

Other GGUF types (F32/F16/BF16 and the K-quants) are not returned: the caller keeps the
transformers-dequantised tensor for them (:attr:`NativeWeights.skipped` says which and why).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["NativeTensor", "NativeWeights", "gguf_to_hf_name", "read_native", "SUPPORTED_TYPES"]

QK = 32
SUPPORTED_TYPES = ("Q4_0", "Q4_1", "Q8_0")

_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_to_hf_name(name: str) -> str | None:
    """The transformers parameter name of a llama-family GGUF tensor (None when unknown)."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        layer = _LAYER.get(m.group(2))
        return None if layer is None else f"model.layers.{m.group(1)}.{layer}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _GLOBAL:
        return f"{_GLOBAL[m.group(1)]}.{m.group(2)}"
    return None


@dataclass
class NativeTensor:
    """One quantized matrix ``[N, K]``: ``codes`` uint8 (int4 in [0, 15]) or int8, ``scales`` and
    ``mins`` fp32 ``[N, K/32]`` (``mins`` None for Q8_0); value = ``fl(fl(s·q) + m)`` or ``s·q``."""

    gguf_name: str
    gguf_type: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def bits(self) -> int:
        return 8 if self.gguf_type == "Q8_0" else 4

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        s = self.scales.repeat_interleave(QK, dim=1)[:, :k]
        q = self.codes.to(torch.float32)
        if self.mins is None:
            return q * s
        return (q * s) + self.mins.repeat_interleave(QK, dim=1)[:, :k]


@dataclass
class NativeWeights:
    """The natively readable tensors of a GGUF, by transformers parameter name."""

    path: str
    tensors: dict[str, NativeTensor] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # gguf name -> reason


def _fp16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32))


def decode_blocks(data: np.ndarray, gguf_type: str, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(codes [N, K], scales [N, K/32], mins [N, K/32] | None)`` of a GGUF tensor's raw rows ``[N, bytes]``."""
    if gguf_type not in SUPPORTED_TYPES:
        raise ValueError(f"GGUF type {gguf_type} has no native int4/int8 layout (supported: "
                         f"{', '.join(SUPPORTED_TYPES)}); it is dequantised by transformers instead")
    if k % QK:
        raise ValueError(f"GGUF {gguf_type}: row length {k} is not a multiple of {QK}")
    n, g = data.shape[0], k // QK
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[gguf_type]
    if data.shape[1] != g * size:
        raise ValueError(f"GGUF {gguf_type}: rows of {data.shape[1]} bytes, expected {g * size} for K={k}")
    blocks = np.asarray(data).reshape(n, g, size)
    d = _fp16(blocks[:, :, 0:2]).reshape(n, g)
    if gguf_type == "Q8_0":
        q = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8)).reshape(n, k)
        return q, d, None
    off = 4 if gguf_type == "Q4_1" else 2
    qs = torch.from_numpy(np.ascontiguousarray(blocks[:, :, off:off + 16]))  # [n, g, 16]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, k)
    if gguf_type == "Q4_1":
        m = _fp16(blocks[:, :, 2:4]).reshape(n, g)
    else:
        m = -8.0 * d  # exact: d is an fp16 value
    return q, d, m


def _reverse_permutation(rows: int, n_head: int) -> torch.Tensor:
    """Row indices that undo llama.cpp's q/k permutation (transformers' ``_reverse_permute_weights``)."""
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(rows)


def read_native(path: str | os.PathLike, num_heads: int | None = None, num_kv_heads: int | None = None
                ) -> NativeWeights:
    """Every Q4_0/Q4_1/Q8_0 tensor of a llama-family GGUF, decoded (not dequantised), rows in
    transformers' order. ``num_heads``/``num_kv_heads`` (the config's) drive the q/k un-permutation."""
    import gguf

    reader = gguf.GGUFReader(os.fspath(path))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8") \
        if "general.architecture" in reader.fields else "llama"
    out = NativeWeights(os.fspath(path))
    for t in reader.tensors:
        qtype = t.tensor_type.name
        hf = gguf_to_hf_name(t.name)
        if qtype not in SUPPORTED_TYPES:
            if qtype not in ("F32", "F16", "BF16"):
                out.skipped[t.name] = f"{qtype} has no native int4/int8 layout here; dequantised by transformers"
            continue
        if hf is None:
            out.skipped[t.name] = "no transformers parameter name for this GGUF tensor"
            continue
        k = int(t.shape[0])  # GGUF shapes are [K, N] (ne0 first)
        codes, scales, mins = decode_blocks(t.data, qtype, k)
        if arch == "llama" and num_heads and num_kv_heads:
            heads = num_heads if ".attn_q." in t.name else num_kv_heads if ".attn_k." in t.name else None
            if heads:
                perm = _reverse_permutation(codes.shape[0], heads)
                codes, scales = codes[perm], scales[perm]
                mins = None if mins is None else mins[perm]
        out.tensors[hf] = NativeTensor(t.name, qtype, codes.contiguous(), scales.contiguous(),
                                       None if mins is None else mins.contiguous())
    return out
