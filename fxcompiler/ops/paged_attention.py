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
"""
from __future__ import annotations

import torch

__all__ = ["paged_attention", "paged_attention_reference"]


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
) -> torch.Tensor:
    """Eager kernel for every device: cache write, block gather, masked softmax attention."""
    write_kv_reference(key, value, k_cache, v_cache, slot_mapping)
    return attend_reference(query, k_cache, v_cache, block_table, query_pos, seq_lens, scale, sliding_window,
                            softcap)


def write_kv_reference(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write this step's K/V rows ``[B, Hkv, S, D]`` into the cache slots ``slot_mapping[B, S]``."""
    B, Hkv, S, D = key.shape
    nb, bs = k_cache.shape[0], k_cache.shape[1]
    slots = slot_mapping.reshape(-1)
    k_cache.view(nb * bs, Hkv, D).index_copy_(0, slots, key.transpose(1, 2).reshape(B * S, Hkv, D).to(k_cache.dtype))
    v_cache.view(nb * bs, Hkv, D).index_copy_(0, slots, value.transpose(1, 2).reshape(B * S, Hkv, D).to(v_cache.dtype))


def attend_reference(query, k_cache, v_cache, block_table, query_pos, seq_lens, scale, sliding_window=-1,
                     softcap=0.0) -> torch.Tensor:
    """Attention of ``query[B, Hq, S, D]`` over the cached context named by the block table."""
    B, Hq, S, D = query.shape
    Hkv = k_cache.shape[2]
    bs = k_cache.shape[1]
    MB = block_table.shape[1]
    L = MB * bs
    flat_blocks = block_table.reshape(-1)
    # [B, MB*bs, Hkv, D] viewed as [B, Hkv, L, D] (strided; SDPA reads it in place)
    k_ctx = k_cache.index_select(0, flat_blocks).view(B, L, Hkv, D).transpose(1, 2)
    v_ctx = v_cache.index_select(0, flat_blocks).view(B, L, Hkv, D).transpose(1, 2)
    if k_ctx.dtype != query.dtype:
        k_ctx = k_ctx.to(query.dtype)
        v_ctx = v_ctx.to(query.dtype)
    j = torch.arange(L, device=query.device)
    allowed = (j.view(1, 1, L) <= query_pos.unsqueeze(-1)) & (j.view(1, 1, L) < seq_lens.view(B, 1, 1))
    if sliding_window > 0:
        allowed &= j.view(1, 1, L) > (query_pos.unsqueeze(-1) - sliding_window)
    if softcap > 0.0:
        return _softcapped_attention(query, k_ctx, v_ctx, allowed, scale, softcap)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, k_ctx, v_ctx, attn_mask=allowed.unsqueeze(1), scale=scale, enable_gqa=Hq != Hkv)
    return out.transpose(1, 2).contiguous()


def _softcapped_attention(query, k_ctx, v_ctx, allowed, scale, softcap):
    """Gemma-2 style: scores = tanh(scores / cap) * cap before the mask (grouped matmul, no K/V repeat)."""
    B, Hq, S, D = query.shape
    Hkv = k_ctx.shape[1]
    G = Hq // Hkv
    q = query.reshape(B, Hkv, G * S, D)
    scores = torch.matmul(q, k_ctx.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    mask = allowed.repeat(1, G, 1).unsqueeze(1)  # rows are g-major like q
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v_ctx)
    return out.view(B, Hq, S, D).transpose(1, 2).contiguous()


_SCHEMA = ("paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
           "Tensor block_table, Tensor slot_mapping, Tensor query_pos, Tensor seq_lens, float scale, "
           "int sliding_window=-1, float softcap=0.0) -> Tensor")

# Defined with the low-level Library API rather than torch.library.custom_op: the op is
# called once per layer per step, and custom_op's Python wrapper costs ~100 us a call.
_lib = torch.library.Library("fxc", "FRAGMENT")
_lib.define(_SCHEMA)
_lib.impl("paged_attention", paged_attention_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("fxc::paged_attention", lib=_lib)
def _fake(query, key, value, k_cache, v_cache, block_table, slot_mapping, query_pos, seq_lens,
          scale, sliding_window=-1, softcap=0.0):
    B, Hq, S, D = query.shape
    return query.new_empty(B, S, Hq, D)


paged_attention = torch.ops.fxc.paged_attention.default
