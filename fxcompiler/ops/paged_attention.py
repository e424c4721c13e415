"""`fxc::paged_attention`: the compiler-visible attention op.

One node per transformer layer in every captured graph. It writes the new K/V rows
of this step into the paged cache (in place) and attends over the context that the
block table names, with causal, padding and optional sliding-window masking done
inside the op (transformers builds no mask for a custom attention implementation).

Cache layout per layer: ``[num_blocks, block_size, kv_heads, head_dim]``. Block 0 is
the null block: padding tokens write there and padded block-table entries read it
(masked out by ``seq_lens``).

Shapes: query ``[B, Hq, S, D]``, key/value ``[B, Hkv, S, D]`` (what transformers'
attention interface hands over), block_table ``[B, MB]``, slot_mapping/query_pos
``[B, S]``, seq_lens ``[B]``; returns ``[B, S, Hq, D]`` (what transformers expects back).
GQA is a grouped matmul: K/V are never repeated per query head.

`fxc::qkv_paged_attention` is the same attention as one node over the fused q/k/v projection
``qkv [B, S, (Hq + 2 Hkv) D]``: the split into heads, the rotary embedding of q and k
(``fxc::rope`` with the given cos/sin, when given) and the ``[B, S, Hq D]`` result view, which
otherwise take ~15 graph nodes a layer (``passes/fusion.py`` ``fuse_qkv_attention`` makes it).
Its reference is exactly that op sequence, so fused and unfused graphs compute the same values.
"""
from __future__ import annotations

import torch

from . import fused  # noqa: F401  (fxc::rope, which qkv_paged_attention applies)

__all__ = ["paged_attention", "paged_attention_reference", "qkv_paged_attention",
           "qkv_paged_attention_reference", "split_qkv_heads", "kv8_scales", "kv8_set_scales", "kv8_quantize",
           "kvf8_quantize", "kv_quantize", "is_quantized_cache", "KV8_QMAX", "FP8_MAX", "KV_QUANT_DTYPES"]

# -- quantized KV caches: int8 ("KV8") and fp8 e4m3 ("KVf8") ----------------------------------------------
# An int8 cache tensor ``[num_blocks, block_size, kv_heads, head_dim]`` holds codes q in [-127, 127]
# (x ~ q * scale); an fp8 one (``torch.float8_e4m3fn``) holds e4m3 values c = e4m3(x / scale), rounded to
# nearest even and saturated at +-448 (x ~ c * scale). Either keeps, in its *last block* (the scale block,
# never handed out by the block manager), the layer's float32 scales: the first 4 * kv_heads bytes are
# ``scale[kv_heads]``. A cache tensor therefore describes itself: every kernel that gets it (ATen
# reference, C++ decode and flash kernels, qkv fusion, copies for copy-on-write) needs no extra argument,
# and the graph is the float model's.
KV8_QMAX = 127
FP8_MAX = 448.0  # the largest finite e4m3fn value
KV_QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def is_quantized_cache(cache: torch.Tensor) -> bool:
    """True for an int8 (KV8) or fp8 e4m3 (KVf8) cache tensor, which carries its scales in its last block."""
    return cache.dtype in KV_QUANT_DTYPES


def kv8_scales(cache: torch.Tensor) -> torch.Tensor:
    """The float32 ``[kv_heads]`` scales stored in an int8 or fp8 cache's last block (a copy)."""
    hkv = cache.shape[2]
    raw = cache[-1].reshape(-1).view(torch.uint8)[: 4 * hkv].clone()  # clone: an aligned buffer for the float view
    return raw.view(torch.float32)


def kv8_set_scales(cache: torch.Tensor, scales) -> None:
    """Store ``scales[kv_heads]`` (positive, finite) in an int8 or fp8 cache's last block."""
    if not is_quantized_cache(cache):
        raise ValueError(f"kv cache scales belong to an int8 or float8_e4m3fn cache, got {cache.dtype}")
    s = torch.as_tensor(scales, dtype=torch.float32).reshape(-1).contiguous()
    hkv = cache.shape[2]
    if s.numel() != hkv:
        raise ValueError(f"kv cache scales: expected {hkv} (one per KV head), got {s.numel()}")
    if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
        raise ValueError(f"kv cache scales must be finite and > 0, got {s.tolist()}")
    if cache[-1].numel() < 4 * hkv:
        raise ValueError("kv cache block too small to hold its scales")
    cache[-1].reshape(-1).view(torch.uint8)[: 4 * hkv].copy_(s.view(torch.uint8).to(cache.device))


def kv8_quantize(x: torch.Tensor, scales: torch.Tensor, head_dim_axis: int = -3) -> torch.Tensor:
    """int8 codes of ``x`` whose axis ``head_dim_axis`` is the KV head: ``clamp(round(x / s), -127, 127)``
    in float32 (round half to even, as the C++ kernel's ``nearbyint``)."""
    shape = [1] * x.dim()
    shape[head_dim_axis] = -1
    q = torch.round(x.to(torch.float32) / scales.to(x.device).view(shape))
    return q.clamp_(-KV8_QMAX, KV8_QMAX).to(torch.int8)


def kvf8_quantize(x: torch.Tensor, scales: torch.Tensor, head_dim_axis: int = -3) -> torch.Tensor:
    """fp8 e4m3 codes of ``x`` whose axis ``head_dim_axis`` is the KV head: ``e4m3(clamp(x / s, -448, 448))``
    in float32, rounded to nearest even (torch's cast; the C++ write computes the same bits). NaN stays NaN."""
    shape = [1] * x.dim()
    shape[head_dim_axis] = -1
    y = x.to(torch.float32) / scales.to(x.device).view(shape)
    return y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def kv_quantize(cache: torch.Tensor, x: torch.Tensor, head_dim_axis: int = -3) -> torch.Tensor:
    """``x`` in ``cache``'s code dtype (int8 or fp8) with the scales of its scale block."""
    fn = kv8_quantize if cache.dtype == torch.int8 else kvf8_quantize
    return fn(x, kv8_scales(cache), head_dim_axis)


def paged_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager kernel for every device: cache write, block gather, masked softmax attention."""
    write_kv_reference(key, value, k_cache, v_cache, slot_mapping)
    return attend_reference(query, k_cache, v_cache, block_table, query_pos, seq_lens, scale, sliding_window,
                            softcap, sinks)


def write_kv_reference(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write this step's K/V rows ``[B, Hkv, S, D]`` into the cache slots ``slot_mapping[B, S]``."""
    B, Hkv, S, D = key.shape
    nb, bs = k_cache.shape[0], k_cache.shape[1]
    slots = slot_mapping.reshape(-1)
    if is_quantized_cache(k_cache):  # KV8 / KVf8: codes with the scales of the cache's scale block
        key = kv_quantize(k_cache, key, 1)
        value = kv_quantize(v_cache, value, 1)
    kd, vd = k_cache, v_cache
    if k_cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no fp8 kernel: copy the bytes
        kd, vd, key, value = (t.view(torch.uint8) for t in (k_cache, v_cache, key, value))
    kd.view(nb * bs, Hkv, D).index_copy_(0, slots, key.transpose(1, 2).reshape(B * S, Hkv, D).to(kd.dtype))
    vd.view(nb * bs, Hkv, D).index_copy_(0, slots, value.transpose(1, 2).reshape(B * S, Hkv, D).to(vd.dtype))


def attend_reference(query, k_cache, v_cache, block_table, query_pos, seq_lens, scale, sliding_window=-1,
                     softcap=0.0, sinks=None) -> torch.Tensor:
    """Attention of ``query[B, Hq, S, D]`` over the cached context named by the block table.

    ``sinks[Hq]`` (GPT-OSS): a per-head logit that joins every row's softmax and is dropped after it,
    i.e. the denominator gains ``exp(sink - max)`` and the numerator nothing."""
    B, Hq, S, D = query.shape
    Hkv = k_cache.shape[2]
    bs = k_cache.shape[1]
    MB = block_table.shape[1]
    L = MB * bs
    flat_blocks = block_table.reshape(-1)
    # [B, MB*bs, Hkv, D] viewed as [B, Hkv, L, D] (strided; SDPA reads it in place)
    k_ctx = k_cache.index_select(0, flat_blocks).view(B, L, Hkv, D).transpose(1, 2)
    v_ctx = v_cache.index_select(0, flat_blocks).view(B, L, Hkv, D).transpose(1, 2)
    if is_quantized_cache(k_cache):  # KV8 / KVf8: dequantized (codes x per-head scale) in the query's dtype
        k_ctx = (k_ctx.to(torch.float32) * kv8_scales(k_cache).view(1, Hkv, 1, 1)).to(query.dtype)
        v_ctx = (v_ctx.to(torch.float32) * kv8_scales(v_cache).view(1, Hkv, 1, 1)).to(query.dtype)
    elif k_ctx.dtype != query.dtype:
        k_ctx = k_ctx.to(query.dtype)
        v_ctx = v_ctx.to(query.dtype)
    j = torch.arange(L, device=query.device)
    allowed = (j.view(1, 1, L) <= query_pos.unsqueeze(-1)) & (j.view(1, 1, L) < seq_lens.view(B, 1, 1))
    if sliding_window > 0:
        allowed &= j.view(1, 1, L) > (query_pos.unsqueeze(-1) - sliding_window)
    if softcap > 0.0 or sinks is not None:
        return _softcapped_attention(query, k_ctx, v_ctx, allowed, scale, softcap, sinks)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, k_ctx, v_ctx, attn_mask=allowed.unsqueeze(1), scale=scale, enable_gqa=Hq != Hkv)
    return out.transpose(1, 2).contiguous()


def _softcapped_attention(query, k_ctx, v_ctx, allowed, scale, softcap, sinks=None):
    """Gemma-2 style: scores = tanh(scores / cap) * cap before the mask (grouped matmul, no K/V repeat);
    GPT-OSS sinks: one extra logit per query head in the softmax, dropped after it."""
    B, Hq, S, D = query.shape
    Hkv = k_ctx.shape[1]
    G = Hq // Hkv
    q = query.reshape(B, Hkv, G * S, D)
    scores = torch.matmul(q, k_ctx.transpose(-1, -2)) * scale
    if softcap > 0.0:
        scores = torch.tanh(scores / softcap) * softcap
    mask = allowed.repeat(1, G, 1).unsqueeze(1)  # rows are g-major like q
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # rows of q are (kv head, g, s): the sink of query head kv * G + g
        sink = sinks.to(scores.dtype).view(1, Hkv, G, 1, 1).expand(B, Hkv, G, S, 1).reshape(B, Hkv, G * S, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = torch.matmul(probs, v_ctx)
    return out.view(B, Hq, S, D).transpose(1, 2).contiguous()


_SCHEMA = ("paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
           "Tensor block_table, Tensor slot_mapping, Tensor query_pos, Tensor seq_lens, float scale, "
           "int sliding_window=-1, float softcap=0.0, Tensor? sinks=None) -> Tensor")

# Defined with the low-level Library API rather than torch.library.custom_op: the op is
# called once per layer per step, and custom_op's Python wrapper costs ~100 us a call.
_lib = torch.library.Library("fxc", "FRAGMENT")
_lib.define(_SCHEMA)
_lib.impl("paged_attention", paged_attention_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("fxc::paged_attention", lib=_lib)
def _fake(query, key, value, k_cache, v_cache, block_table, slot_mapping, query_pos, seq_lens,
          scale, sliding_window=-1, softcap=0.0, sinks=None):
    B, Hq, S, D = query.shape
    return query.new_empty(B, S, Hq, D)


paged_attention = torch.ops.fxc.paged_attention.default


def qkv_head_dim(qkv: torch.Tensor, num_heads: int, num_kv_heads: int) -> int:
    """``head_dim`` of a fused projection ``qkv [B, S, (Hq + 2 Hkv) D]``; ValueError when it is not one."""
    if qkv.dim() != 3:
        raise ValueError(f"qkv_paged_attention: qkv must be [B, S, (num_heads + 2 * num_kv_heads) * head_dim], "
                         f"got shape {tuple(qkv.shape)}")
    W = qkv.shape[-1]
    heads = num_heads + 2 * num_kv_heads
    if num_heads < 1 or num_kv_heads < 1 or W % heads:
        raise ValueError(f"qkv_paged_attention: qkv's last dim {W} is not (num_heads + 2 * num_kv_heads) * head_dim "
                         f"for num_heads={num_heads}, num_kv_heads={num_kv_heads}")
    return W // heads


def split_qkv_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int):
    """Views ``q [B, Hq, S, D]``, ``k`` and ``v [B, Hkv, S, D]`` of a fused projection ``qkv [B, S, (Hq + 2 Hkv) D]``."""
    D = qkv_head_dim(qkv, num_heads, num_kv_heads)
    B, S, _ = qkv.shape
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], -1)
    return (q.view(B, S, num_heads, D).permute(0, 2, 1, 3), k.view(B, S, num_kv_heads, D).permute(0, 2, 1, 3),
            v.view(B, S, num_kv_heads, D).permute(0, 2, 1, 3))


def qkv_paged_attention_reference(qkv, cos, sin, k_cache, v_cache, block_table, slot_mapping, query_pos, seq_lens,
                                  num_heads: int, num_kv_heads: int, scale: float, sliding_window: int = -1,
                                  softcap: float = 0.0, *, rope=None, attention=None) -> torch.Tensor:
    """Split ``qkv`` into heads, rotate q and k (``cos``/``sin`` given), attend, ``[B, S, Hq * D]``.

    ``rope`` / ``attention`` default to the ``fxc`` ops (so each runs its device kernel);
    ``fxcompiler.edf`` passes ATen references where a package must not call them."""
    if (cos is None) != (sin is None):
        raise ValueError("qkv_paged_attention: give both cos and sin, or neither")
    q, k, v = split_qkv_heads(qkv, num_heads, num_kv_heads)
    if cos is not None:
        rope = rope or torch.ops.fxc.rope.default
        q, k = rope(q, cos, sin), rope(k, cos, sin)
    attention = attention or torch.ops.fxc.paged_attention.default
    out = attention(q, k, v, k_cache, v_cache, block_table, slot_mapping, query_pos, seq_lens, scale,
                    sliding_window, softcap)
    return out.reshape(qkv.shape[0], qkv.shape[1], -1)


_lib.define("qkv_paged_attention(Tensor qkv, Tensor? cos, Tensor? sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
            "Tensor block_table, Tensor slot_mapping, Tensor query_pos, Tensor seq_lens, int num_heads, "
            "int num_kv_heads, float scale, int sliding_window=-1, float softcap=0.0) -> Tensor")
_lib.impl("qkv_paged_attention", qkv_paged_attention_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("fxc::qkv_paged_attention", lib=_lib)
def _qkv_fake(qkv, cos, sin, k_cache, v_cache, block_table, slot_mapping, query_pos, seq_lens, num_heads,
              num_kv_heads, scale, sliding_window=-1, softcap=0.0):
    # shapes only: building the split views under fake mode cost ~0.1 s a node (symbolic guards)
    return qkv.new_empty(qkv.shape[0], qkv.shape[1], num_heads * qkv_head_dim(qkv, num_heads, num_kv_heads))


qkv_paged_attention = torch.ops.fxc.qkv_paged_attention.default
