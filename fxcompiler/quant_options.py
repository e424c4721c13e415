"""From ``LLM``'s quantization arguments to the ``quantize`` pass's options (``options["quantization"]``).

* ``llm_config.quantization_config``: ``W16A16`` → the ``auto_bfloat16_cast`` pass; ``W8A16`` /
  ``W8A32`` → int8 weights (per channel, or ``quantization_group_size``) with bf16 / fp32
  activations; ``W4A16`` / ``W4A32`` → int4 weights, group ``quantization_group_size`` (default 128);
  ``Wf8A16`` / ``Wf8A32`` → fp8 (e4m3) weights with a scale per output channel; ``W8A8`` → int8 weights per
  channel with per-token int8 activations (``activation: int8``, ``fxc::linear_w8a8``; fp32 elsewhere); ``W4A8`` →
  int4 weights as W4A16 (and a kept GGUF's int4 blocks) with int8 activations per token and weight group
  (``fxc::linear_w4a8``);
  everything else raises ``NotImplementedError`` with the reason (:func:`quant_config.supported_reason`).
* ``keep_gguf_quantization=True`` (a GGUF source, e.g. the embedded default): the checkpoint's
  Q4_0/Q4_1/Q4_K/Q8_0/Q5_0/Q6_K blocks are used as they are (exact); other tensors stay as transformers
  dequantised them. With a weight scheme as well, the matmuls without native blocks get that scheme.
* ``quantize_lm_head=True``: the output projection is quantized too (int8, or the native blocks of a GGUF's
  tied ``token_embd``), as llama.cpp does. ``None`` (default): with ``keep_gguf_quantization`` the output runs
  on the checkpoint's own blocks where they are natively readable (``lm_head: "native"``: exactly the
  checkpoint's weights, never re-quantized), else it is kept in float; ``False`` keeps it in float.
* ``qformat_path`` (+ ``qparam_path``): per-module schemes and, optionally, their scales
  (:mod:`fxcompiler.qformat`, :mod:`fxcompiler.qparam`), cross-checked against ``llm_config``;
* ``quant_ckpt_file_path`` (or a model directory whose config.json has a ``quantization_config``):
  a pre-quantised compressed-tensors / GPTQ / AWQ checkpoint, unpacked by :mod:`fxcompiler.quant_ckpt`
  into a qformat + qparam directory (:func:`resolve_quant_checkpoint`), then loaded like one.
"""
from __future__ import annotations

import os
from typing import Any

from .quant_config import QDtype, QuantizationConfig, supported_reason

__all__ = ["directory_quantization_files", "quantization_options", "resolve_quant_checkpoint"]

QFORMAT_FILE, QPARAM_FILE = "qformat.yaml", "qparam.safetensors"


def directory_quantization_files(model) -> tuple[str | None, str | None]:
    """``(qformat, qparam)`` paths of a model directory written by ``fxcompiler quantize`` (None when absent)."""
    if not isinstance(model, (str, os.PathLike)) or not os.path.isdir(model):
        return None, None
    qformat, qparam = os.path.join(model, QFORMAT_FILE), os.path.join(model, QPARAM_FILE)
    if not os.path.isfile(qformat):
        return None, None
    return qformat, (qparam if os.path.isfile(qparam) else None)


def resolve_quant_checkpoint(model, quant_args: dict[str, Any], cache_dir) -> tuple[Any, dict[str, Any]]:
    """``(model, quant_args)`` with a pre-quantised checkpoint (``quant_ckpt_file_path``, or a model directory
    whose config.json has a ``quantization_config``) replaced by its converted qformat + qparam directory."""
    ckpt = quant_args.get("quant_ckpt_file_path")
    model_dir = None
    if isinstance(model, (str, os.PathLike)) and os.path.isfile(os.path.join(model, "config.json")):
        model_dir = os.fspath(model)
    if ckpt is None:
        from .quant_ckpt import find_quantization_config

        qc = find_quantization_config(model_dir) if model_dir is not None else None
        if qc is None:
            return model, quant_args
        if quant_args.get("qformat_path") is not None:
            raise ValueError(f"model={os.fspath(model)!r} is a pre-quantised checkpoint (quantization_config in "
                             "config.json) and qformat_path is set; use one of them")
        ckpt = model_dir
    elif model_dir is None:  # a model id: its config and tokenizer, when it resolves to an HF-format directory
        from .models.sources import resolve_model_source

        try:
            src = resolve_model_source(model)
        except ValueError:
            src = None  # the checkpoint's own config.json must do
        model_dir = os.fspath(src.path) if src is not None and src.kind in ("hf_dir", "hf_cache") else None
    from .quant_ckpt import convert_quant_checkpoint

    out = convert_quant_checkpoint(ckpt, model_dir, cache_dir)
    qformat, qparam = directory_quantization_files(out)
    return os.fspath(out), {**quant_args, "quant_ckpt_file_path": None, "qformat_path": qformat,
                            "qparam_path": qparam}


def quantization_options(quantization_config: QuantizationConfig | None, *, qformat_path=None, qparam_path=None,
                         quant_ckpt_file_path=None, keep_gguf_quantization: bool = False,
                         quantize_lm_head: bool | None = None, group_size: int | None = None,
                         gguf_path: os.PathLike | None = None, model_config: Any = None, check_source: bool = True
                         ) -> tuple[dict[str, Any] | None, bool]:
    """``(options["quantization"] or None, auto_bfloat16_cast)`` for the given arguments
    (``check_source=False``: validate the arguments only, before the model is resolved)."""
    if quant_ckpt_file_path is not None:
        if not isinstance(quant_ckpt_file_path, (str, os.PathLike)):
            raise TypeError(f"quant_ckpt_file_path must be a path, got {type(quant_ckpt_file_path).__name__}")
        if not os.path.exists(quant_ckpt_file_path):
            raise ValueError(f"quant_ckpt_file_path={os.fspath(quant_ckpt_file_path)!r} does not exist (a pre-quantised "
                             "compressed-tensors / GPTQ / AWQ checkpoint: a directory or a .safetensors file)")
        if qformat_path is not None or qparam_path is not None:
            raise ValueError("quant_ckpt_file_path and qformat_path/qparam_path both set: a pre-quantised checkpoint "
                             "brings its own codes and scales")
        if check_source:
            raise ValueError(f"quant_ckpt_file_path={os.fspath(quant_ckpt_file_path)!r} must be resolved with "
                             "resolve_quant_checkpoint() first")
    qformat = None
    if qparam_path is not None and qformat_path is None:
        raise ValueError(f"qparam_path={os.fspath(qparam_path)!r} needs a qformat_path saying which modules it quantizes")
    if qformat_path is not None:
        from .qformat import load_qformat

        qformat = load_qformat(qformat_path)
        quantization_config = _cross_check(qformat.config, quantization_config, qformat.path)
    if not isinstance(keep_gguf_quantization, bool):
        raise TypeError(f"keep_gguf_quantization must be a bool, got {keep_gguf_quantization!r}")
    if quantize_lm_head is not None and not isinstance(quantize_lm_head, bool):
        raise TypeError(f"quantize_lm_head must be a bool or None (the default), got {quantize_lm_head!r}")
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
        if qformat is not None:
            if group_size is not None:
                raise ValueError("quantization_group_size and qformat_path both set: the qformat's schemes give "
                                 "the group sizes")
            opts = {"weight": "rules", **qformat.to_options(), "qformat_sha256": qformat.sha256}
            if qparam_path is not None:
                from .qparam import load_qparam, qparam_digest

                load_qparam(qparam_path)  # refuses pickle and unreadable files before anything is built
                opts["qparam"] = {"path": os.fspath(qparam_path), "sha256": qparam_digest(qparam_path)}
        elif w == QDtype.INT8:
            opts = {"weight": "int8", "group_size": -1 if group_size is None else group_size}
        elif w == QDtype.INT4:
            if group_size == -1:
                raise ValueError("quantization_group_size=-1 (per channel) is not available for int4 weights; "
                                 "use 32, 64 or 128")
            opts = {"weight": "int4", "group_size": 128 if group_size is None else group_size}
        elif w == QDtype.FP8:
            if group_size not in (None, -1):
                raise ValueError(f"quantization_group_size={group_size} with fp8 weights: fxc::linear_f8 has one "
                                 "scale per output channel (use -1 or leave it unset)")
            opts = {"weight": "fp8", "group_size": -1}
    if opts and quantization_config is not None and quantization_config.activation == QDtype.INT8:
        if quantization_config.weight == QDtype.INT4 and qformat is None:
            if opts["group_size"] % 8:
                raise ValueError(f"quantization_group_size={group_size} with W4A8: the activations are quantized per "
                                 "weight group, whose size must be a multiple of 8 (32, 64, 128)")
        elif opts.get("group_size", -1) != -1 and quantization_config.weight == QDtype.INT8:
            raise ValueError(f"quantization_group_size={group_size} with W8A8: int8 activations take one weight "
                             "scale per output channel (use -1 or leave it unset)")
        opts["activation"] = "int8"
        _refuse_moe_activations(quantization_config, model_config, "int8-activation (W8A8 / W4A8) kernel; it",
                                "weight-only W8A16 / W4A16 / Wf8A16 build")
        if qformat is not None and qformat.metadata.get("algorithm") == "smoothquant":
            opts["smoothquant"] = True
    if opts and quantization_config is not None and quantization_config.activation == QDtype.FP8:
        opts["activation"] = "fp8"  # Wf8Af8: per-token e4m3 activations (fxc::linear_f8f8)
        _refuse_moe_activations(quantization_config, model_config, "fp8-activation kernel; Wf8Af8",
                                "Wf8A16 builds")
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
    if quantize_lm_head and qformat is not None:
        raise ValueError("quantize_lm_head and qformat_path both set: name lm_head in the qformat's modules instead")
    if quantize_lm_head:
        if not opts:
            raise ValueError("quantize_lm_head=True needs a weight quantization scheme or keep_gguf_quantization=True")
        opts["lm_head"] = True
    elif opts:  # a kept GGUF's output on the tied table's own blocks unless quantize_lm_head=False
        opts["lm_head"] = "native" if keep_gguf_quantization and quantize_lm_head is None else False
    if opts and quantization_config is not None:
        opts["scheme"] = str(quantization_config)
    elif opts:
        opts["scheme"] = "gguf-native"
    return (opts or None), bf16


def _refuse_moe_activations(quantization_config: QuantizationConfig, model_config: Any, kernel: str,
                            instead: str) -> None:
    """Quantized activations are built for dense decoder layers: MoE experts run inside ``fxc::moe``."""
    experts = next((getattr(model_config, a) for a in ("num_local_experts", "num_experts", "n_routed_experts")
                    if getattr(model_config, a, None)), None)
    if experts:
        raise NotImplementedError(
            f"llm_config.quantization_config={quantization_config} on model type "
            f"{getattr(model_config, 'model_type', '?')!r}: its {experts} MoE experts run inside fxc::moe, which "
            f"has no {kernel} is built for dense decoder layers ({instead} for this model)")


def quantized_kv_dtype(quantization_config: QuantizationConfig | None, qformat_path=None) -> QDtype | None:
    """The KV-cache dtype the quantization arguments name (a qformat's ``--kv_dtype``, cross-checked against
    ``llm_config.quantization_config``, else the config's ``kv_cache``), or None when they name none.
    ``QDtype.INT8`` turns on the int8 KV cache (``kv_cache_dtype="int8"``, docs/quantization.md KV8)."""
    if qformat_path is not None:
        from .qformat import load_qformat

        fmt = load_qformat(qformat_path)
        return _cross_check(fmt.config, quantization_config, fmt.path).kv_cache
    return None if quantization_config is None else quantization_config.kv_cache


def _cross_check(fmt: QuantizationConfig, given: QuantizationConfig | None, path: str) -> QuantizationConfig:
    """The qformat's config, checked against ``llm_config.quantization_config`` as furiosa does: the weight
    and activation dtypes must agree, and so must the KV-cache dtype; the KV cache of a float scheme is
    kept in the activation dtype, so a qformat's float ``--kv_dtype`` must be that dtype."""
    if given is not None and (given.weight, given.activation) != (fmt.weight, fmt.activation):
        raise ValueError(f"qformat_path={path!r} describes {fmt} but llm_config.quantization_config is {given}")
    if given is not None and given.kv_cache is not None and fmt.kv_cache is not None and given.kv_cache != fmt.kv_cache:
        raise ValueError(f"qformat_path={path!r}: --kv_dtype {fmt.kv_cache.value} conflicts with "
                         f"llm_config.quantization_config.kv_cache={given.kv_cache.value}")
    kv = fmt.kv_cache if fmt.kv_cache is not None else (given.kv_cache if given is not None else None)
    reason = supported_reason(QuantizationConfig(fmt.weight, fmt.activation, kv))
    if reason is not None:
        raise NotImplementedError(f"qformat_path={path!r}: {reason}")
    if (kv is not None and kv.is_float and kv != QDtype.FP8 and kv != fmt.activation and fmt.activation.is_float
            and fmt.activation != QDtype.FP8):  # fp8 activations (like int8 ones) keep an fp32 cache for bf16/fp32
        raise ValueError(f"qformat_path={path!r}: --kv_dtype {kv.value} with --act_dtype {fmt.activation.value}: the "
                         "KV cache is kept in the activation dtype (or quantized: --kv_dtype int8 / fp8)")
    return QuantizationConfig(fmt.weight, fmt.activation, kv, fmt.use_mcp)
