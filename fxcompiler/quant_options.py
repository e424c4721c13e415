"""From ``LLM``'s quantization arguments to the ``quantize`` pass's options (``options["quantization"]``).

* ``llm_config.quantization_config``: ``W16A16`` → the ``auto_bfloat16_cast`` pass; ``W8A16`` /
  ``W8A32`` → int8 weights (per channel, or ``quantization_group_size``) with bf16 / fp32
  activations; ``W4A16`` / ``W4A32`` → int4 weights, group ``quantization_group_size`` (default 128);
  everything else raises ``NotImplementedError`` with the reason (:func:`quant_config.supported_reason`).
* ``keep_gguf_quantization=True`` (a GGUF source, e.g. the embedded default): the checkpoint's
  Q4_0/Q4_1/Q8_0 blocks are used as they are (exact); other tensors stay as transformers
  dequantised them. With a weight scheme as well, the matmuls without native blocks get that scheme.
* ``quantize_lm_head=True``: the output projection is quantized too (int8; Q8_0 blocks of a GGUF's
  tied ``token_embd``), as llama.cpp does; it is kept in float by default.
* ``qformat_path`` / ``qparam_path`` / ``quant_ckpt_file_path``: not implemented (raise).
"""
from __future__ import annotations

import os
from typing import Any

from .quant_config import QDtype, QuantizationConfig, supported_reason

__all__ = ["quantization_options"]


def quantization_options(quantization_config: QuantizationConfig | None, *, qformat_path=None, qparam_path=None,
                         quant_ckpt_file_path=None, keep_gguf_quantization: bool = False,
                         quantize_lm_head: bool = False, group_size: int | None = None,
                         gguf_path: os.PathLike | None = None, model_config: Any = None, check_source: bool = True
                         ) -> tuple[dict[str, Any] | None, bool]:
    """``(options["quantization"] or None, auto_bfloat16_cast)`` for the given arguments
    (``check_source=False``: validate the arguments only, before the model is resolved)."""
    for name, value in (("qformat_path", qformat_path), ("qparam_path", qparam_path),
                        ("quant_ckpt_file_path", quant_ckpt_file_path)):
        if value is not None:
            raise NotImplementedError(
                f"{name}={os.fspath(value)!r}: reading furiosa qformat/qparam files and pre-quantised checkpoints "
                "is not implemented yet (issue 17); use llm_config=LLMConfig(quantization_config=...) for RTN "
                "weight-only quantization, or keep_gguf_quantization=True for a GGUF's own blocks")
    for name, value in (("keep_gguf_quantization", keep_gguf_quantization), ("quantize_lm_head", quantize_lm_head)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                   or not (group_size == -1 or (group_size > 0 and group_size % 2 == 0))):
        raise ValueError(f"quantization_group_size must be -1 (per channel) or a positive even int such as "
                         f"32, 64, 128, got {group_size!r}")
    if quantization_config is not None and not isinstance(quantization_config, QuantizationConfig):
        raise TypeError("llm_config.quantization_config must be a QuantizationConfig, got "
                        f"{type(quantization_config).__name__}")
    opts: dict[str, Any] = {}
    bf16 = False
    if quantization_config is not None:
        reason = supported_reason(quantization_config)
        if reason is not None:
            raise NotImplementedError(reason)
        w, a = quantization_config.weight, quantization_config.activation
        bf16 = a == QDtype.BF16
        if w == QDtype.INT8:
            opts = {"weight": "int8", "group_size": -1 if group_size is None else group_size}
        elif w == QDtype.INT4:
            if group_size == -1:
                raise ValueError("quantization_group_size=-1 (per channel) is not available for int4 weights; "
                                 "use 32, 64 or 128")
            opts = {"weight": "int4", "group_size": 128 if group_size is None else group_size}
    if keep_gguf_quantization and not check_source:
        opts.setdefault("weight", "native")
    elif keep_gguf_quantization:
        if gguf_path is None:
            raise ValueError("keep_gguf_quantization=True needs a GGUF model (a .gguf file or the embedded default)")
        from .models.loader import _file_digest

        opts.setdefault("weight", "native")
        opts["gguf"] = {"path": os.fspath(gguf_path), "sha256": _file_digest(gguf_path),
                        "num_heads": getattr(model_config, "num_attention_heads", None),
                        "num_kv_heads": getattr(model_config, "num_key_value_heads", None)}
    if quantize_lm_head:
        if not opts:
            raise ValueError("quantize_lm_head=True needs a weight quantization scheme or keep_gguf_quantization=True")
        opts["lm_head"] = True
    elif opts:
        opts["lm_head"] = False
    if opts and quantization_config is not None:
        opts["scheme"] = str(quantization_config)
    elif opts:
        opts["scheme"] = "gguf-native"
    return (opts or None), bf16
