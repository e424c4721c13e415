"""Route transformers' attention through `fxc::paged_attention`.

Registered once with ``transformers.AttentionInterface`` under the name ``fxc_paged``;
a loaded model is switched with ``model.set_attn_implementation("fxc_paged")``. The
paged-KV metadata reaches the function as extra forward kwargs (``fxc_*``), which
transformers passes through unchanged from ``model.base_model(...)`` to every layer.
Some decoder layers (StableLM's) do not forward their ``**kwargs`` to the attention module;
for those the metadata of the call in progress is read from :func:`paged_inputs`, which the
capture wrapper sets around its forward.

Per-layer settings arrive as the attention interface's kwargs and become the op's arguments:
``sliding_window`` (Mistral, Gemma 2/3, EXAONE 4, GPT-OSS sliding layers), ``softcap`` (Gemma 2),
``s_aux`` (GPT-OSS attention sinks, one logit per query head).
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

from ..ops.paged_attention import paged_attention

ATTN_IMPLEMENTATION = "fxc_paged"
_registered: set[str] = set()  # attention implementations registered with transformers
_current: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fxc_paged_inputs", default=None)


@contextlib.contextmanager
def paged_inputs(metadata: dict):
    """Make ``metadata`` (the ``fxc_*`` kwargs) the paged inputs of attention calls that did not get them."""
    token = _current.set(metadata)
    try:
        yield
    finally:
        _current.reset(token)


def fxc_paged_attention_forward(module, query, key, value, attention_mask, scaling=None,
                                dropout=0.0, sliding_window=None, softcap=None, s_aux=None, **kwargs):
    layer = module.layer_idx
    meta = kwargs if "fxc_k_caches" in kwargs else _current.get()
    if meta is None:
        raise RuntimeError(f"{type(module).__name__} (layer {layer}): fxc_paged attention called without the paged "
                           "KV inputs (fxc_* kwargs); run the model through fxcompiler.capture")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    extra = () if s_aux is None else (s_aux,)
    out = paged_attention(
        query, key, value,
        meta["fxc_k_caches"][layer], meta["fxc_v_caches"][layer],
        meta["fxc_block_table"], meta["fxc_slot_mapping"],
        meta["fxc_query_pos"], meta["fxc_seq_lens"],
        float(scaling),
        int(sliding_window) if sliding_window else -1,
        float(softcap) if softcap else 0.0,
        *extra,
    )
    return out, None


def register_attention_function(name: str, fn) -> str:
    """Register ``fn`` as transformers' attention implementation ``name`` (once per process); returns ``name``."""
    if name not in _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(name, fn)
        _registered.add(name)
    return name


def register_attention() -> str:
    """Register the attention function (idempotent) and return its implementation name."""
    return register_attention_function(ATTN_IMPLEMENTATION, fxc_paged_attention_forward)


def use_paged_attention(model: torch.nn.Module) -> None:
    """Switch an already-loaded transformers model to the paged-attention op."""
    register_attention()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
