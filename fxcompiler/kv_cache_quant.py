"""Quantized KV caches, int8 (KV8) and fp8 e4m3 (KVf8): the ``kv_cache_dtype`` option and the calibration
of their static scales.

``kv_cache_dtype="auto"`` (default) keeps the model's dtype (fp32, or bf16 with ``auto_bfloat16_cast``);
``"int8"`` stores int8 codes with one float32 scale per layer and KV head for K and for V
(vLLM's ``k_scale``/``v_scale``; x ~ code * scale, code = clamp(round(x / scale), -127, 127));
``"fp8"`` (also ``"fp8_e4m3"``, vLLM's names; ``torch.float8_e4m3fn``) stores e4m3 values
code = e4m3(clamp(x / scale, -448, 448)) (round to nearest even) with the same scales.
The scales are static: :func:`quantize_kv_cache` takes the absmax (observer ``minmax``) or a high percentile
of |x| (observer ``percentile``, e.g. 99.99: the few largest values then saturate) of every layer's K and V
(after the rotary embedding, i.e. what the cache stores) per KV head over calibration text run through the
float-cache engine, times a margin (1.05), divided by the code's largest value (127 or 448). Without given
scales, ``LLM(..., kv_cache_dtype="int8" | "fp8")`` calibrates at build time on a built-in sample
(:data:`DEFAULT_CALIBRATION_TOKENS` tokens of the calibration half of ``pydoc_data.topics``, the half that
perplexity is never measured on); vLLM instead takes scale 1.0 for an fp8 cache whose checkpoint has none,
which saturates any |K| above 448 and sends values below 2^-6 into e4m3's subnormals, so fxcompiler
calibrates (``kv_cache_scales=1.0``-style unit scales can still be given explicitly).
Layout: ``fxcompiler/ops/paged_attention.py`` (the scale block).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

__all__ = ["KV_CACHE_DTYPES", "KV_TORCH_DTYPES", "KV_QMAX", "KV_SCALES_FILE", "DEFAULT_MARGIN", "DEFAULT_CALIBRATION_TOKENS",
           "DEFAULT_PERCENTILE", "KV_OBSERVERS", "check_kv_observer", "parse_kv_cache_dtype",
           "quantize_kv_cache", "calibration_text", "save_kv_scales", "load_kv_scales", "check_kv_scales"]

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
KV_TORCH_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # the cache tensors' dtype
KV_QMAX = {"int8": 127.0, "fp8": 448.0}  # the largest code value: scale = amax * margin / qmax
_ALIASES = {"fp8_e4m3": "fp8", "fp8-e4m3": "fp8", "float8_e4m3fn": "fp8", "e4m3": "fp8"}
KV_SCALES_FILE = "kv_cache_scales.json"
DEFAULT_MARGIN = 1.05
DEFAULT_CALIBRATION_TOKENS = 1024
KV_OBSERVERS = ("minmax", "percentile")
DEFAULT_PERCENTILE = 99.99  # of |x| per layer and KV head, observer "percentile"
_MIN_SCALE = 1e-8  # a head whose calibration values are all zero still gets a usable scale


def parse_kv_cache_dtype(value) -> str:
    """``"auto"``, ``"int8"`` (also ``torch.int8``) or ``"fp8"`` (also ``"fp8_e4m3"``, ``torch.float8_e4m3fn``);
    ValueError naming ``kv_cache_dtype`` otherwise (``"fp8_e5m2"`` included: only e4m3 caches are built)."""
    if value is torch.int8:
        return "int8"
    if value is torch.float8_e4m3fn:
        return "fp8"
    if isinstance(value, str):
        text = value.strip().lower()
        text = _ALIASES.get(text, text)
        if text in KV_CACHE_DTYPES:
            return text
    raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)} (or 'fp8_e4m3'), got {value!r} "
                     "(fp8_e5m2 caches are not implemented)")


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


def check_kv_observer(observer: str, percentile: float | None) -> tuple[str, float | None]:
    """``(observer, percentile)`` checked: observer ``minmax`` (percentile must be None) or ``percentile``
    (percentile in (0, 100], default :data:`DEFAULT_PERCENTILE`); ValueError naming the option otherwise."""
    if observer not in KV_OBSERVERS:
        raise ValueError(f"--kv-observer must be one of {list(KV_OBSERVERS)}, got {observer!r}")
    if observer == "minmax":
        if percentile is not None:
            raise ValueError(f"--kv-percentile applies to --kv-observer percentile, got --kv-observer {observer}")
        return observer, None
    if percentile is None:
        return observer, DEFAULT_PERCENTILE
    if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 < percentile <= 100:
        raise ValueError(f"--kv-percentile must be a number in (0, 100], got {percentile!r}")
    return observer, float(percentile)


def _percentile(chunks: list[torch.Tensor], q: float) -> torch.Tensor:
    """Per row of the ``[H, n_i]`` chunks concatenated: the nearest-rank ``q``-th percentile (the
    ``ceil(q/100 · n)``-th smallest value; 100 = the max)."""
    x = torch.cat(chunks, dim=1)
    n = x.shape[1]
    rank = min(n, max(1, math.ceil(q * n / 100 - 1e-9)))  # 1e-9: 99.99 * 10000 / 100 is 9999, not 9999.000001
    return x.kthvalue(rank, dim=1).values


def _prompt_block_table(engine, run) -> torch.Tensor:
    """The block table (int64 block ids) of the one sequence ``run()`` serves, read as the scheduler frees it;
    prefix-cache hits included (their blocks hold the same prompt's values), nothing of the cache modified."""
    blocks = getattr(getattr(engine, "scheduler", None), "blocks", None)
    if blocks is None:
        raise NotImplementedError("quantize_kv_cache(observer='percentile') needs an engine with a block manager")
    tables: list[torch.Tensor] = []
    free = blocks.free

    def recording_free(seq):
        if seq.slot >= 0:
            tables.append(torch.from_numpy(blocks.block_tables[seq.slot, :int(blocks.num_seq_blocks[seq.slot])].copy()))
        return free(seq)

    blocks.free = recording_free
    try:
        run()
    finally:
        del blocks.free  # the class's method again
    if len(tables) != 1:
        raise RuntimeError(f"quantize_kv_cache: expected the calibration prompt's sequence to be freed once, saw "
                           f"{len(tables)}")
    return tables[0]


def quantize_kv_cache(llm, text: str | list[str] | None = None, *, num_tokens: int = DEFAULT_CALIBRATION_TOKENS,
                      margin: float = DEFAULT_MARGIN, kv_dtype: str = "int8", observer: str = "minmax",
                      percentile: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Static KV8 / KVf8 scales ``(k_scales, v_scales)``, each ``[num_layers, num_kv_heads]`` float32, of a
    running float-cache ``llm``: its caches' absmax (``observer="minmax"``) or nearest-rank ``percentile``-th
    percentile of |x| (``observer="percentile"``, default :data:`DEFAULT_PERCENTILE`; the values of the tokens
    written, the empty slots of the last block excluded) per layer and KV head after prefilling ``num_tokens``
    tokens of ``text`` (default: :func:`calibration_text`), times ``margin``, / 127 (``kv_dtype="int8"``) or
    / 448 (``"fp8"``)."""
    if margin < 1.0:
        raise ValueError(f"margin must be >= 1.0, got {margin!r}")
    observer, percentile = check_kv_observer(observer, percentile)
    if kv_dtype not in KV_QMAX:
        raise ValueError(f"kv_dtype must be one of {list(KV_QMAX)}, got {kv_dtype!r}")
    qmax = KV_QMAX[kv_dtype]
    engine = getattr(llm, "engine", None)
    runner = getattr(engine, "runner", None)
    kv = getattr(runner, "kv", None)
    if kv is None or not hasattr(kv, "k"):
        raise NotImplementedError("quantize_kv_cache needs a single-process engine whose KV cache this process "
                                  "holds (tensor/pipeline/data-parallel engines keep it in their workers)")
    if kv.dtype in KV_TORCH_DTYPES.values():
        raise ValueError("quantize_kv_cache needs an engine with a float KV cache (kv_cache_dtype='auto')")
    from .sampling_params import SamplingParams  # noqa: PLC0415

    window = max(16, min(llm.prompt_max_seq_len, llm.max_seq_len_to_capture - 1, 512))  # room for the 1 token
    prompts = _token_windows(llm, calibration_text() if text is None else text, num_tokens, window)
    heads = kv.k[0].shape[2]
    k_amax = torch.zeros(len(kv.k), heads)
    v_amax = torch.zeros_like(k_amax)
    k_abs: list[list[torch.Tensor]] = [[] for _ in kv.k]  # percentile: |x| of the written slots, [H, n] chunks
    v_abs: list[list[torch.Tensor]] = [[] for _ in kv.k]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for p in prompts:  # one at a time: the cache is read after each, before its blocks are reused
        if observer == "percentile":  # exactly the prompt's slots, through the blocks its sequence held
            table = _prompt_block_table(engine, lambda: llm.generate(None, params, prompt_token_ids=[p]))
            bs = kv.k[0].shape[1]
            pos = torch.arange(len(p))
            blk, off = table[pos // bs], pos % bs
            for i, (k, v) in enumerate(zip(kv.k, kv.v)):
                for t, out in ((k, k_abs[i]), (v, v_abs[i])):  # [tokens, H, D] -> [H, tokens * D]
                    out.append(t[blk, off].abs().float().transpose(0, 1).reshape(heads, -1))
            continue
        llm.generate(None, params, prompt_token_ids=[p])
        for i, (k, v) in enumerate(zip(kv.k, kv.v)):
            k_amax[i] = torch.maximum(k_amax[i], k[1:kv.num_blocks].abs().amax(dim=(0, 1, 3)).float())
            v_amax[i] = torch.maximum(v_amax[i], v[1:kv.num_blocks].abs().amax(dim=(0, 1, 3)).float())
    if observer == "percentile":
        for i in range(len(kv.k)):
            k_amax[i], v_amax[i] = _percentile(k_abs[i], percentile), _percentile(v_abs[i], percentile)
    return ((k_amax * margin / qmax).clamp_min(_MIN_SCALE), (v_amax * margin / qmax).clamp_min(_MIN_SCALE))


def check_kv_scales(scales, num_layers: int, num_kv_heads: int, what: str = "kv_cache_scales"):
    """``(k, v)`` float32 ``[num_layers, num_kv_heads]`` tensors from a pair / dict / file path, or one number for
    every scale (e.g. ``1.0``, what vLLM takes for an fp8 cache without scales); a ``[num_layers]`` scale (vLLM's
    per-layer ``k_scale``) is repeated over the KV heads. Errors name ``what``."""
    if isinstance(scales, (str, os.PathLike)):
        scales = load_kv_scales(scales)
    if isinstance(scales, (int, float)) and not isinstance(scales, bool):
        scales = (torch.full((num_layers, num_kv_heads), float(scales)),) * 2
    if isinstance(scales, dict):
        scales = (scales.get("k_scale"), scales.get("v_scale"))
    try:
        k, v = (torch.as_tensor(x, dtype=torch.float32) for x in scales)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{what} must be (k_scales, v_scales), {{'k_scale': ..., 'v_scale': ...}} or one positive "
                         f"number: {exc}") from None
    k, v = (t.view(-1, 1).expand(num_layers, num_kv_heads).contiguous() if tuple(t.shape) == (num_layers,) else t
            for t in (k, v))
    for name, t in (("k_scale", k), ("v_scale", v)):
        if tuple(t.shape) != (num_layers, num_kv_heads):
            raise ValueError(f"{what}: {name} must be [num_layers={num_layers}, num_kv_heads={num_kv_heads}], "
                             f"got {list(t.shape)}")
        if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
            raise ValueError(f"{what}: {name} must be finite and > 0")
    return k, v


def save_kv_scales(path, k: torch.Tensor, v: torch.Tensor, extra: dict | None = None, kv_dtype: str = "int8") -> Path:
    """Write ``kv_cache_scales.json`` (``path`` a directory or a file) for an ``int8`` or ``fp8`` cache."""
    if kv_dtype not in KV_QMAX:
        raise ValueError(f"kv_dtype must be one of {list(KV_QMAX)}, got {kv_dtype!r}")
    path = Path(path)
    if path.is_dir():
        path = path / KV_SCALES_FILE
    data = {"kv_cache_dtype": kv_dtype, "k_scale": k.tolist(), "v_scale": v.tolist(), **(extra or {})}
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
    if data.get("kv_cache_dtype") not in KV_QMAX or "k_scale" not in data or "v_scale" not in data:
        raise ValueError(f"kv_cache_scales={str(path)!r}: expected kv_cache_dtype 'int8' or 'fp8', k_scale and "
                         f"v_scale, got kv_cache_dtype {data.get('kv_cache_dtype')!r}")
    return data
