"""Capture-time forms of transformers' sequence-length-dependent rotary embeddings.

transformers recomputes ``inv_freq`` inside the rotary module's forward for ``dynamic`` and
``longrope`` rope types (``dynamic_rope_update``): from ``max(position_ids) + 1`` over the *whole
batch*, with state kept on the module between calls. That is not exportable as is (a data-dependent
branch for ``dynamic``) and, batched, would let one sequence's length change another's rotation.
During capture the rotary modules of those types get a stateless, per-row forward instead:

* ``longrope`` (Phi-3): each row uses the long factors when its own ``max(position_ids) + 1``
  exceeds ``original_max_position_embeddings``, else the short ones: what transformers computes
  for a single sequence step by step (prefill at the prompt length, then one token a step).
* ``dynamic`` (NTK): transformers only rescales beyond ``max_position_embeddings``
  (``seq_len = max(seq_len, max_position_embeddings)``), which :class:`fxcompiler.LLM` never
  reaches (it refuses longer sequences), so the default frequencies are exact.

Layer-typed rope parameters (a dict per layer type) of these two types are not supported and raise.
"""
from __future__ import annotations

import contextlib
import types

import torch

__all__ = ["stateless_rope"]

_DYNAMIC_TYPES = ("dynamic", "longrope")


def _rope_type(module) -> str | dict | None:
    return getattr(module, "rope_type", None)


def _longrope_forward(long_inv_freq: torch.Tensor, short_inv_freq: torch.Tensor, original_max: int):
    def forward(self, x, position_ids):
        seq_len = position_ids.amax(dim=-1, keepdim=True) + 1  # [B, 1]: each row's own length
        use_long = (seq_len > original_max).unsqueeze(-1)  # [B, 1, 1]
        inv = torch.where(use_long, long_inv_freq.to(x.device).float(), short_inv_freq.to(x.device).float())
        freqs = position_ids[..., None].float() * inv  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)
    return forward


def _static_forward(inv_freq: torch.Tensor):
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)
    return forward


def _replacement(module):
    kind = _rope_type(module)
    if isinstance(kind, dict):
        if any(str(v) in _DYNAMIC_TYPES for v in kind.values()):
            raise NotImplementedError(f"{type(module).__name__}: per-layer-type rope of type {kind} "
                                      f"(dynamic/longrope per layer type) is not supported by fxcompiler's capture")
        return None
    if kind == "longrope":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        original_max = int(module.config.rope_parameters["original_max_position_embeddings"])
        long_inv, _ = ROPE_INIT_FUNCTIONS["longrope"](module.config, None, seq_len=original_max + 1)
        return _longrope_forward(long_inv, module.original_inv_freq.clone(), original_max)
    if kind == "dynamic":
        return _static_forward(module.original_inv_freq.clone())
    return None


@contextlib.contextmanager
def stateless_rope(model: torch.nn.Module):
    """Within the block, the model's ``dynamic``/``longrope`` rotary modules run per-row and stateless."""
    patched = []
    for module in model.modules():
        if _rope_type(module) is None or not hasattr(module, "original_inv_freq"):
            continue
        forward = _replacement(module)
        if forward is not None:
            patched.append(module)
            module.forward = types.MethodType(forward, module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward  # back to the class's forward
