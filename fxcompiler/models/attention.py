"""Route transformers' attention through `fxc::paged_attention`.

Registered once with ``transformers.AttentionInterface`` under the name ``fxc_paged``;
a loaded model is switched with ``model.set_attn_implementation("fxc_paged")``. The
paged-KV metadata reaches the function as extra forward kwargs (``fxc_*``), which
transformers passes through unchanged from ``model.base_model(...)`` to every layer.
"""
from __future__ import annotations

import torch

from ..ops.paged_attention import paged_attention

ATTN_IMPLEMENTATION = "fxc_paged"
_registered = False


def fxc_paged_attention_forward(module, query, key, value, attention_mask, scaling=None,
                                dropout=0.0, sliding_window=None, softcap=None, **kwargs):
    layer = module.layer_idx
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = paged_attention(
        query, key, value,
        kwargs["fxc_k_caches"][layer], kwargs["fxc_v_caches"][layer],
        kwargs["fxc_block_table"], kwargs["fxc_slot_mapping"],
        kwargs["fxc_query_pos"], kwargs["fxc_seq_lens"],
        float(scaling),
        int(sliding_window) if sliding_window else -1,
        float(softcap) if softcap else 0.0,
    )
    return out, None


def register_attention() -> str:
    """Register the attention function (idempotent) and return its implementation name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, fxc_paged_attention_forward)
        _registered = True
    return ATTN_IMPLEMENTATION


def use_paged_attention(model: torch.nn.Module) -> None:
    """Switch an already-loaded transformers model to the paged-attention op."""
    register_attention()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
