"""Early, specific errors for models fxcompiler cannot compile.

A user pointing ``LLM(...)`` at an unsupported checkpoint gets a ``NotImplementedError`` naming the
architecture and the first construct that is not supported, instead of a stack trace from deep inside
transformers or ``torch.export``. Checked in order:

1. the config (``check_config``): a ``model_type`` transformers does not know; an encoder-decoder
   (cross-attention over encoder states has no form in ``fxc::paged_attention``); a config with no
   causal-LM class;
2. the captured graph (``check_attention_routed``): every decoder layer's attention must have become one
   ``fxc::paged_attention`` node. A model whose attention bypasses transformers' attention interface (a
   custom attention) leaves fewer; the error names the first attention-like node of the graph
   (softmax / SDPA) and the model source line it came from.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["UnsupportedModelError", "check_config", "check_attention_routed", "unknown_config_error"]


class UnsupportedModelError(NotImplementedError):
    """The model's architecture (or one of its constructs) cannot be compiled by fxcompiler."""


def _architecture(config: Any) -> str:
    archs = getattr(config, "architectures", None) or []
    return archs[0] if archs else type(config).__name__


def unknown_config_error(model_dir: Path, error: Exception) -> UnsupportedModelError:
    """The error for a config.json that transformers cannot map to a config class."""
    import json

    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}
    arch = (raw.get("architectures") or ["<no architectures>"])[0]
    return UnsupportedModelError(
        f"{arch}: config.json in {model_dir} names model_type {raw.get('model_type')!r}, which transformers does "
        f"not know (no config class; trust_remote_code models are not supported either): {error}")


def check_config(config: Any) -> None:
    """Raise :class:`UnsupportedModelError` for configs fxcompiler cannot compile (see the module doc)."""
    arch = _architecture(config)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{arch}: encoder-decoder models are not supported; first unsupported construct: the decoder's "
            "cross-attention over encoder states (fxc::paged_attention attends over the decoder's own paged KV "
            "cache only)")
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "model_type", None) not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and \
            type(config) not in AutoModelForCausalLM._model_mapping:
        raise UnsupportedModelError(
            f"{arch}: model_type {getattr(config, 'model_type', None)!r} has no causal-LM class in transformers; "
            "fxcompiler compiles decoder-only causal LMs (AutoModelForCausalLM)")


def _first_attention_like(gm: torch.fx.GraphModule):
    aten = torch.ops.aten
    targets = (aten._softmax.default, aten.softmax.int, aten.scaled_dot_product_attention.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in targets:
            return node
    return None


def check_attention_routed(model: torch.nn.Module, gm: torch.fx.GraphModule, num_layers: int) -> None:
    """Every layer's attention must be a ``fxc::paged_attention`` node in the exported graph."""
    routed = sum(1 for n in gm.graph.nodes if n.op == "call_function" and "paged_attention" in str(n.target))
    if routed >= num_layers:
        return
    arch = type(model).__name__
    node = _first_attention_like(gm)
    where = ""
    if node is not None:
        trace = (node.meta.get("stack_trace") or "").strip().splitlines()
        files = [line.strip() for line in trace if line.strip().startswith("File ")]
        source = files[-1] if files else "unknown source line"
        code = trace[-1].strip() if trace else ""
        where = f"; first unsupported construct: {node.target} (node {node.name}) at {source}: {code}"
    raise UnsupportedModelError(
        f"{arch}: only {routed} of {num_layers} layers' attention went through transformers' attention "
        f"interface to fxc::paged_attention (a custom attention the op cannot express){where}")
