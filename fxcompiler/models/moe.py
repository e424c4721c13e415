"""The capture's MoE rewrite: transformers' sparse-MoE blocks become one ``fxc::moe`` call.

Requires: a transformers model whose MoE blocks are Mixtral's ``MixtralSparseMoeBlock``, Qwen3-MoE's
``Qwen3MoeSparseMoeBlock`` or GPT-OSS's ``GptOssMLP`` (recognised by class name and checked for the
router/experts layout the op expresses: a linear router, ``[gate; up]`` SiLU experts or GPT-OSS's
interleaved clamped SwiGLU, optional biases).
Ensures: within :func:`fxc_moe_blocks`, each recognised block's forward is router + top-k + experts as
one compiler-visible ``fxc::moe`` node of the exported graph (the weights stay the block's own
parameters). Blocks it does not recognise (another activation, jitter noise in training, shared
experts) keep transformers' forward, which the capture exports with the ``batched_mm`` experts.
"""
from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass

import torch

from ..ops.moe import CLAMPED_SWIGLU, SILU_GLU, SOFTMAX_TOPK, TOPK_SOFTMAX, moe

__all__ = ["MoeSpec", "fxc_moe_blocks", "moe_spec"]


@dataclass(frozen=True)
class MoeSpec:
    """How one block's router and experts map onto ``fxc::moe``'s arguments."""

    router: str  # attribute of the block holding the router (``gate`` or ``router``)
    scoring: int
    normalize: bool
    fp32_weights: bool
    activation: int
    transposed: bool
    returns_scores: bool  # GPT-OSS's block returns (hidden, router_scores)


def _act_is_silu(experts) -> bool:
    act = getattr(experts, "act_fn", None)
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def moe_spec(block: torch.nn.Module) -> MoeSpec | None:
    """The :class:`MoeSpec` of a recognised MoE block, or None."""
    name = type(block).__name__
    experts = getattr(block, "experts", None)
    if experts is None or not hasattr(experts, "gate_up_proj") or not hasattr(experts, "down_proj"):
        return None
    if name == "MixtralSparseMoeBlock" and _act_is_silu(experts) and not getattr(experts, "has_bias", False):
        return MoeSpec("gate", SOFTMAX_TOPK, True, True, SILU_GLU, False, False)
    if name == "Qwen3MoeSparseMoeBlock" and _act_is_silu(experts) and not getattr(experts, "has_bias", False):
        return MoeSpec("gate", SOFTMAX_TOPK, bool(block.gate.norm_topk_prob), False, SILU_GLU, False, False)
    if name == "GptOssMLP":
        return MoeSpec("router", TOPK_SOFTMAX, False, False, CLAMPED_SWIGLU, True, True)
    return None


def _forward(spec: MoeSpec):
    def forward(self, hidden_states):
        if self.training and getattr(self, "jitter_noise", 0) > 0:
            raise NotImplementedError("fxc::moe: router jitter noise (training) is not supported")
        b, s, h = hidden_states.shape
        router, experts = getattr(self, spec.router), self.experts
        out = moe(hidden_states.reshape(-1, h), router.weight, getattr(router, "bias", None), experts.gate_up_proj,
                  getattr(experts, "gate_up_proj_bias", None), experts.down_proj,
                  getattr(experts, "down_proj_bias", None), int(router.top_k), spec.scoring, spec.normalize,
                  spec.fp32_weights, spec.activation, spec.transposed, float(getattr(experts, "alpha", 1.702)),
                  float(getattr(experts, "limit", 7.0))).reshape(b, s, h)
        return (out, None) if spec.returns_scores else out
    return forward


@contextlib.contextmanager
def fxc_moe_blocks(model: torch.nn.Module):
    """Within the block, the model's recognised MoE blocks run as ``fxc::moe`` (yields how many)."""
    patched = []
    for module in model.modules():
        spec = moe_spec(module)
        if spec is not None:
            module.forward = types.MethodType(_forward(spec), module)
            patched.append(module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward
