"""GGUF quantized tensors read natively (no dequantisation): Q4_0, Q4_1, Q4_K → int4 codes + scale + min
per group of 32, Q8_0 and Q5_0 → int8 codes + a scale per group of 32, Q6_K → int8 codes + a scale per
group of 16, with the q/k row permutation of llama.cpp's converter undone.

Block layouts (ggml ``QK = 32`` values per block, little-endian, as in ggml-common.h / gguf-py):

* Q4_0, 18 bytes: ``d`` fp16, ``qs[16]``; value ``j`` (0..15) is ``qs[j] & 0xF``, value ``j + 16`` is
  ``qs[j] >> 4``; ``x = d · (q − 8)``.
* Q4_1, 20 bytes: ``d`` fp16, ``m`` fp16, ``qs[16]`` as Q4_0; ``x = d · q + m``.
* Q8_0, 34 bytes: ``d`` fp16, ``qs[32]`` int8; ``x = d · q``.
* Q5_0, 22 bytes: ``d`` fp16, ``qh`` (32 high bits, little-endian uint32), ``qs[16]`` as Q4_0 for the low
  nibbles; ``q = (nibble | high bit << 4) − 16`` in [−16, 15], ``x = d · q``: int8 codes, exact.

K-quants: super-blocks of ``QK_K = 256`` values along K.

* Q4_K, 144 bytes: ``d``, ``dmin`` fp16, 12 bytes of eight 6-bit scales ``sc`` and mins ``mn``, ``qs[128]``
  (32 bytes per pair of sub-blocks: low nibbles the first 32 values, high nibbles the next 32);
  ``x = (d·sc)·q − dmin·mn`` per sub-block of 32: int4 with scale ``d·sc`` and min ``−dmin·mn``. Both
  products are exact in fp32 (an fp16 times a 6-bit integer), so the values equal gguf-py's bit for bit.
* Q6_K, 210 bytes: ``ql[128]`` (low nibbles), ``qh[64]`` (high 2 bits), ``scales[16]`` int8, ``d`` fp16;
  ``q`` in [−32, 31], ``x = (d·sc)·q`` per sub-block of 16: int8 codes with a scale per group of 16.

llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of ``attn_q`` / ``attn_k`` of llama-family
models (rotary halves interleaved); transformers undoes it on load (``_reverse_permute_weights``).
Blocks run along K (a row), so the row permutation moves whole rows of blocks: :func:`read_native`
applies the same inverse permutation to the codes, scales and mins, exactly.

Other GGUF types (F32/F16/BF16, Q5_1, Q2_K, Q3_K, Q5_K, the i-quants) are not returned: the caller keeps
the transformers-dequantised tensor for them (:attr:`NativeWeights.skipped` says which and why; the
``quantize`` pass logs it). Q5_1 and Q5_K have 5-bit codes with a min, which neither the int4 layout
(4 bits) nor the int8 one (no min) holds exactly.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["NativeTensor", "NativeWeights", "gguf_to_hf_name", "read_native", "SUPPORTED_TYPES"]

QK = 32
QK_K = 256
SUPPORTED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K")
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q4_K": 144, "Q6_K": 210}
BLOCK_VALUES = {"Q4_0": QK, "Q4_1": QK, "Q8_0": QK, "Q5_0": QK, "Q4_K": QK_K, "Q6_K": QK_K}
GROUP = {"Q4_0": QK, "Q4_1": QK, "Q8_0": QK, "Q5_0": QK, "Q4_K": QK, "Q6_K": 16}  # values per scale
INT8_TYPES = ("Q8_0", "Q5_0", "Q6_K")

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
    ``mins`` fp32 ``[N, K/group]`` (``mins`` None for the int8 types); value = ``fl(fl(s·q) + m)`` or ``s·q``."""

    gguf_name: str
    gguf_type: str
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def bits(self) -> int:
        return 8 if self.gguf_type in INT8_TYPES else 4

    @property
    def group(self) -> int:
        return GROUP[self.gguf_type]

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """The fp32 values of ``rows`` (all by default; a slice keeps a check of a large table in small pieces)."""
        k = self.codes.shape[1]
        s = self.scales[rows].repeat_interleave(self.group, dim=1)[:, :k]
        q = self.codes[rows].to(torch.float32)
        if self.mins is None:
            return q * s
        return (q * s) + self.mins[rows].repeat_interleave(self.group, dim=1)[:, :k]


@dataclass
class NativeWeights:
    """The natively readable tensors of a GGUF, by transformers parameter name (:func:`read_native`: decoded
    from the file's mapped bytes on each access, nothing kept)."""

    path: str
    tensors: Mapping[str, NativeTensor] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # gguf name -> reason


class _DecodedOnAccess(Mapping):
    """transformers name -> :class:`NativeTensor`, decoded when looked up and not cached: a build holds one
    tensor's codes (1 byte a value) while it packs it, never the whole model's at once (SmolLM2: 170 MiB)."""

    def __init__(self, entries: dict[str, tuple], num_heads: int | None, num_kv_heads: int | None, arch: str):
        self._entries, self._heads, self._arch = entries, (num_heads, num_kv_heads), arch

    def __getitem__(self, name: str) -> NativeTensor:
        return _decode_tensor(*self._entries[name], *self._heads, self._arch)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


def _fp16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16).astype(np.float32))


def decode_blocks(data: np.ndarray, gguf_type: str, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(codes [N, K], scales [N, K/g], mins [N, K/g] | None)`` of a GGUF tensor's raw rows ``[N, bytes]``
    (``g = GROUP[gguf_type]``)."""
    if gguf_type not in SUPPORTED_TYPES:
        raise ValueError(f"GGUF type {gguf_type} has no native int4/int8 layout (supported: "
                         f"{', '.join(SUPPORTED_TYPES)}); it is dequantised by transformers instead")
    per = BLOCK_VALUES[gguf_type]
    if k % per:
        raise ValueError(f"GGUF {gguf_type}: row length {k} is not a multiple of {per}")
    n, nb, size = data.shape[0], k // per, BLOCK_BYTES[gguf_type]
    if data.shape[1] != nb * size:
        raise ValueError(f"GGUF {gguf_type}: rows of {data.shape[1]} bytes, expected {nb * size} for K={k}")
    blocks = np.ascontiguousarray(data).reshape(n * nb, size)
    if gguf_type == "Q4_K":
        return _decode_q4_k(blocks, n, k)
    if gguf_type == "Q6_K":
        return _decode_q6_k(blocks, n, k)
    g = nb
    d = _fp16(blocks[:, 0:2]).reshape(n, g)
    if gguf_type == "Q8_0":
        q = torch.from_numpy(np.ascontiguousarray(blocks[:, 2:]).view(np.int8)).reshape(n, k)
        return q, d, None
    if gguf_type == "Q5_0":
        qh = np.ascontiguousarray(blocks[:, 2:6]).view("<u4").reshape(-1, 1)  # bit j: value j's fifth bit
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [n*g, 32]
        low = _nibbles(blocks[:, 6:22])
        q = (low | (high << 4)).astype(np.int8) - np.int8(16)
        return torch.from_numpy(q).reshape(n, k), d, None
    off = 4 if gguf_type == "Q4_1" else 2
    q = torch.from_numpy(_nibbles(blocks[:, off:off + 16])).reshape(n, k)
    if gguf_type == "Q4_1":
        m = _fp16(blocks[:, 2:4]).reshape(n, g)
    else:
        m = -8.0 * d  # exact: d is an fp16 value
    return q, d, m


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[B, 16]`` bytes → ``[B, 32]`` values: the low nibbles, then the high ones (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _decode_q4_k(blocks: np.ndarray, n: int, k: int):
    from gguf.quants import Q4_K

    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))  # [B, 8] 6-bit each
    d = np.ascontiguousarray(blocks[:, 0:2]).view(np.float16).astype(np.float32)  # [B, 1]
    dmin = np.ascontiguousarray(blocks[:, 2:4]).view(np.float16).astype(np.float32)
    scales = d * sc.astype(np.float32)  # exact in fp32
    mins = -(dmin * mn.astype(np.float32))
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(n, k)
    g = k // QK
    return (torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(scales.reshape(n, g)),
            torch.from_numpy(mins.reshape(n, g)))


def _decode_q6_k(blocks: np.ndarray, n: int, k: int):
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(-1, 8, 32)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(-1, 8, 32)
    q = (ql | (qh << 4)).astype(np.int8) - np.int8(32)
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)  # [B, 16]
    d = np.ascontiguousarray(blocks[:, 208:210]).view(np.float16).astype(np.float32)  # [B, 1]
    return (torch.from_numpy(np.ascontiguousarray(q).reshape(n, k)),
            torch.from_numpy((d * sc).reshape(n, k // 16)), None)


def _reverse_permutation(rows: int, n_head: int) -> torch.Tensor:
    """Row indices that undo llama.cpp's q/k permutation (transformers' ``_reverse_permute_weights``)."""
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(rows)


def read_native(path: str | os.PathLike, num_heads: int | None = None, num_kv_heads: int | None = None
                ) -> NativeWeights:
    """Every natively readable tensor (:data:`SUPPORTED_TYPES`) of a llama-family GGUF, decoded (not dequantised), rows in
    transformers' order. ``num_heads``/``num_kv_heads`` (the config's) drive the q/k un-permutation. The header
    is read now; each tensor's blocks are decoded when ``tensors[name]`` is looked up (the file stays mapped)."""
    import gguf

    reader = gguf.GGUFReader(os.fspath(path))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8") \
        if "general.architecture" in reader.fields else "llama"
    out = NativeWeights(os.fspath(path))
    entries: dict[str, tuple] = {}
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
        entries[hf] = (t.name, qtype, int(t.shape[0]), t.data)  # GGUF shapes are [K, N] (ne0 first)
    reader.fields.clear()  # the vocabulary's ~10^5 small arrays: freed now, not interleaved with the build's objects
    out.tensors = _DecodedOnAccess(entries, num_heads, num_kv_heads, arch)
    return out


def _decode_tensor(name: str, qtype: str, k: int, data: np.ndarray, num_heads: int | None, num_kv_heads: int | None,
                   arch: str) -> NativeTensor:
    """One GGUF tensor's raw rows ``data`` decoded, rows in transformers' order."""
    codes, scales, mins = decode_blocks(data, qtype, k)
    if arch == "llama" and num_heads and num_kv_heads:
        heads = num_heads if ".attn_q." in name else num_kv_heads if ".attn_k." in name else None
        if heads:
            perm = _reverse_permutation(codes.shape[0], heads)
            codes, scales = codes[perm], scales[perm]
            mins = None if mins is None else mins[perm]
    return NativeTensor(name, qtype, codes.contiguous(), scales.contiguous(),
                        None if mins is None else mins.contiguous())
