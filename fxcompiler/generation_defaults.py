"""Sampling defaults from a model's ``generation_config.json`` (vLLM's behaviour).

When a request (the server) or the CLI's ``generate`` / ``chat`` leaves temperature, top_p, top_k,
min_p, repetition_penalty or max tokens unset, the value comes from the model's
``generation_config.json`` if the model has one, otherwise from the caller's own default. A
``GenerationConfig`` that transformers derived from ``config.json`` (no file; ``_from_model_config``)
gives no defaults. ``do_sample`` is ignored, as in vLLM: a temperature in the file is used as is.
"""
from __future__ import annotations

from typing import Any

__all__ = ["GENERATION_FIELDS", "generation_defaults"]

# generation_config field -> SamplingParams field (vLLM's ``get_diff_sampling_param``)
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(generation_config: Any) -> dict[str, Any]:
    """The sampling defaults ``generation_config`` sets, as SamplingParams field -> value (may be empty)."""
    if generation_config is None or getattr(generation_config, "_from_model_config", False):
        return {}
    out: dict[str, Any] = {}
    for src, dst in GENERATION_FIELDS.items():
        value = getattr(generation_config, src, None)
        if value is None:
            continue
        if dst == "top_k" and value == 0:
            value = -1  # transformers' "no top-k"
        out[dst] = value
    return out
