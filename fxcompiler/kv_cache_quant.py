"""The int8 KV cache (KV8): the ``kv_cache_dtype`` option and the calibration of its static scales.

``kv_cache_dtype="auto"`` (default) keeps the model's dtype (fp32, or bf16 with ``auto_bfloat16_cast``);
``"int8"`` stores int8 codes with one float32 scale per layer and KV head for K and for V
(vLLM's ``k_scale``/``v_scale``; x ~ code * scale, code = clamp(round(x / scale), -127, 127)).
The scales are static: :func:`quantize_kv_cache` takes the absmax of every layer's K and V (after the
rotary embedding, i.e. what the cache stores) per KV head over calibration text run through the
float-cache engine, times a margin (1.05), divided by 127. Without given scales, ``LLM(...,
kv_cache_dtype="int8")`` calibrates at build time on a built-in sample (:data:`DEFAULT_CALIBRATION_TOKENS`
tokens of the calibration half of ``pydoc_data.topics``, the half that perplexity is never measured on).
Layout: ``fxcompiler/ops/paged_attention.py`` (the scale block).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

__all__ = ["KV_CACHE_DTYPES", "KV_SCALES_FILE", "DEFAULT_MARGIN", "DEFAULT_CALIBRATION_TOKENS", "parse_kv_cache_dtype",
           "quantize_kv_cache", "calibration_text", "save_kv_scales", "load_kv_scales", "check_kv_scales"]

KV_CACHE_DTYPES = ("auto", "int8")
KV_SCALES_FILE = "kv_cache_scales.json"
DEFAULT_MARGIN = 1.05
DEFAULT_CALIBRATION_TOKENS = 1024
_MIN_SCALE = 1e-8  # a head whose calibration values are all zero still gets a usable scale


def parse_kv_cache_dtype(value) -> str:
    """``"auto"`` or ``"int8"`` (also ``torch.int8``); ValueError naming ``kv_cache_dtype`` otherwise."""
    if value is torch.int8:
        return "int8"
    if isinstance(value, str) and value.strip().lower() in KV_CACHE_DTYPES:
        return value.strip().lower()
    raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {value!r} "
                     "(fp8 KV caches are not implemented)")


def calibration_text(max_chars: int | None = None) -> str:
    """The calibration half (even-indexed topics) of ``pydoc_data.topics``, as the weight schemes use."""
    from .calibration import calibration_text as calib_half  # noqa: PLC0415

    calib = calib_half()
    return calib if max_chars is None else calib[:max_chars]


def _token_windows(llm, text: str | list[str], num_tokens: int, window: int) -> list[list[int]]:
    texts = [text] if isinstance(text, str) else list(text)
    ids: list[int] = []
    vocab = llm.geometry.vocab_size
    for t in texts:  # without a tokenizer: the text's UTF-8 bytes (mod the vocabulary)
        ids += (llm.tokenizer(t, add_special_tokens=False)["input_ids"] if llm.tokenizer is not None
                else [c % vocab for c in t.encode("utf-8")])
    ids = ids[:num_tokens]
    if not ids:
        raise ValueError("quantize_kv_cache: the calibration text is empty")
    return [ids[i:i + window] for i in range(0, len(ids), window)]


def quantize_kv_cache(llm, text: str | list[str] | None = None, *, num_tokens: int = DEFAULT_CALIBRATION_TOKENS,
                      margin: float = DEFAULT_MARGIN) -> tuple[torch.Tensor, torch.Tensor]:
    """Static KV8 scales ``(k_scales, v_scales)``, each ``[num_layers, num_kv_heads]`` float32, of a running
    float-cache ``llm``: its caches' absmax per layer and KV head after prefilling ``num_tokens`` tokens of
    ``text`` (default: :func:`calibration_text`), times ``margin``, / 127."""
    if margin < 1.0:
        raise ValueError(f"margin must be >= 1.0, got {margin!r}")
    engine = getattr(llm, "engine", None)
    runner = getattr(engine, "runner", None)
    kv = getattr(runner, "kv", None)
    if kv is None or not hasattr(kv, "k"):
        raise NotImplementedError("quantize_kv_cache needs a single-process engine whose KV cache this process "
                                  "holds (tensor/pipeline/data-parallel engines keep it in their workers)")
    if kv.dtype == torch.int8:
        raise ValueError("quantize_kv_cache needs an engine with a float KV cache (kv_cache_dtype='auto')")
    from .sampling_params import SamplingParams  # noqa: PLC0415

    window = max(16, min(llm.prompt_max_seq_len, llm.max_seq_len_to_capture - 1, 512))  # room for the 1 token
    prompts = _token_windows(llm, calibration_text() if text is None else text, num_tokens, window)
    k_amax = torch.zeros(len(kv.k), kv.k[0].shape[2])
    v_amax = torch.zeros_like(k_amax)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for p in prompts:  # one at a time: the cache is read after each, before its blocks are reused
        llm.generate(None, params, prompt_token_ids=[p])
        for i, (k, v) in enumerate(zip(kv.k, kv.v)):
            k_amax[i] = torch.maximum(k_amax[i], k[1:kv.num_blocks].abs().amax(dim=(0, 1, 3)).float())
            v_amax[i] = torch.maximum(v_amax[i], v[1:kv.num_blocks].abs().amax(dim=(0, 1, 3)).float())
    return ((k_amax * margin / 127).clamp_min(_MIN_SCALE), (v_amax * margin / 127).clamp_min(_MIN_SCALE))


def check_kv_scales(scales, num_layers: int, num_kv_heads: int, what: str = "kv_cache_scales"):
    """``(k, v)`` float32 ``[num_layers, num_kv_heads]`` tensors from a pair / dict / file path; errors name ``what``."""
    if isinstance(scales, (str, os.PathLike)):
        scales = load_kv_scales(scales)
    if isinstance(scales, dict):
        scales = (scales.get("k_scale"), scales.get("v_scale"))
    try:
        k, v = (torch.as_tensor(x, dtype=torch.float32) for x in scales)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{what} must be (k_scales, v_scales) or {{'k_scale': ..., 'v_scale': ...}}: {exc}") from None
    for name, t in (("k_scale", k), ("v_scale", v)):
        if tuple(t.shape) != (num_layers, num_kv_heads):
            raise ValueError(f"{what}: {name} must be [num_layers={num_layers}, num_kv_heads={num_kv_heads}], "
                             f"got {list(t.shape)}")
        if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
            raise ValueError(f"{what}: {name} must be finite and > 0")
    return k, v


def save_kv_scales(path, k: torch.Tensor, v: torch.Tensor, extra: dict | None = None) -> Path:
    """Write ``kv_cache_scales.json`` (``path`` a directory or a file)."""
    path = Path(path)
    if path.is_dir():
        path = path / KV_SCALES_FILE
    data = {"kv_cache_dtype": "int8", "k_scale": k.tolist(), "v_scale": v.tolist(), **(extra or {})}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    return path


def load_kv_scales(path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / KV_SCALES_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"kv_cache_scales={str(path)!r} cannot be read: {exc}") from exc
    if data.get("kv_cache_dtype") != "int8" or "k_scale" not in data or "v_scale" not in data:
        raise ValueError(f"kv_cache_scales={str(path)!r}: expected kv_cache_dtype 'int8', k_scale and v_scale")
    return data
