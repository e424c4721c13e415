"""``fxcompiler quantize MODEL OUT``: write a quantized model directory that ``LLM(OUT)`` loads.

OUT holds the model's own files (config, tokenizer, float safetensors weights) plus

* ``qformat.yaml``: furiosa's metadata line and the scheme every linear module gets (lm_head and
  embeddings kept in float);
* ``qparam.safetensors``: per module ``M.weight_scale``, ``M.weight_min`` (int4) and ``M.qweight``
  (the codes), as :mod:`fxcompiler.qparam` defines them;
* ``quantization_recipe.json``: scheme, algorithm, seed, the calibration data's source and sha256,
  the qformat/qparam digests.

Built: RTN (round to nearest) and GPTQ (:mod:`fxcompiler.gptq`, calibrated on ``--num-samples`` windows of
``--seq-len`` tokens of the calibration text) for ``w8a16`` (int8 per channel) and ``w4a16-g{32,64,128}``
(asymmetric int4 per group), and ``fp8`` (``wf8a16``: e4m3 weights, a scale ``amax / 448`` per channel,
bf16 activations; GPTQ too), ``wf8af8`` (the same fp8 weights, RTN or GPTQ, with per-token e4m3
activations at run time: ``fxc::linear_f8f8``; the qformat says ``--act_dtype fp8 --kv_dtype fp32``, the rest of
the model runs in fp32 as W8A8), and ``w8a8`` (int8 weights per channel, per-token int8 activations at run time:
``fxc::linear_w8a8``) with RTN, GPTQ or ``smoothquant`` (:mod:`fxcompiler.smoothquant`: factors from the
calibration windows, folded into the RMSNorm and linear weights OUT's safetensors then hold, recorded as
``M.smooth_factor``; then RTN), and ``w4a8-g{32,64,128}`` (the ``w4a16`` weights, RTN or GPTQ, with int8
activations per token and weight group at run time: ``fxc::linear_w4a8``; the rest of the model in fp32).

``kv8`` / ``kvf8`` (alone, or after a weight scheme: ``w8a16+kv8``, ``wf8af8+kvf8``) adds
``kv_cache_scales.json``: static per-layer, per-KV-head scales of an int8 / fp8 e4m3 KV cache
(:mod:`fxcompiler.kv_cache_quant`), calibrated by prefilling ``kv_calib_tokens`` tokens of the calibration text
through the model OUT describes (its quantized weights included) with a float cache, with the ``kv_observer``
``minmax`` (absmax) or ``percentile`` (the ``kv_percentile``-th percentile of |x|). ``LLM(OUT)`` then runs with
``kv_cache_dtype="int8"`` / ``"fp8"`` and these scales, without calibrating at start-up.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import secrets
import sys
from pathlib import Path

import torch

from .qformat import ModuleScheme, write_qformat
from .qparam import qparam_digest, save_qparam
from .quant_config import QuantizationConfig
from .quant_options import QFORMAT_FILE, QPARAM_FILE

__all__ = ["RECIPE_FILE", "parse_scheme", "quantize_model"]

RECIPE_FILE = "quantization_recipe.json"
_BUILT = ("w8a16, w4a16-g32, w4a16-g64, w4a16-g128, fp8 (= wf8a16), wf8af8, w8a8, w4a8-g32, w4a8-g64, w4a8-g128, "
          "each optionally +kv8 or +kvf8, or kv8 / kvf8 alone")
_KV_SCHEMES = {"kv8": "int8", "kvf8": "fp8"}  # KV-cache scheme -> kv_cache_dtype


def split_scheme(scheme: str) -> tuple[str | None, str | None]:
    """``"w8a16+kv8"`` → (``"w8a16"``, ``"int8"``); ``"kvf8"`` → (None, ``"fp8"``); ``"w8a16"`` → (``"w8a16"``,
    None): the weight scheme and the KV cache's dtype."""
    if not isinstance(scheme, str):
        raise TypeError(f"--scheme must be a string, got {type(scheme).__name__}")
    parts = [p.strip().lower() for p in scheme.split("+")]
    weights = [p for p in parts if p not in _KV_SCHEMES]
    kvs = [p for p in parts if p in _KV_SCHEMES]
    if "" in parts or len(weights) > 1 or len(kvs) > 1:
        raise ValueError(f"--scheme must be one weight scheme, kv8 or kvf8, or a weight scheme +kv8 / +kvf8 (e.g. "
                         f"w8a16+kv8), got {scheme!r}")
    return (weights[0] if weights else None), (_KV_SCHEMES[kvs[0]] if kvs else None)


def parse_scheme(scheme: str) -> tuple[QuantizationConfig, ModuleScheme]:
    """``w8a16`` | ``w4a16-g{32,64,128}`` | ``fp8`` / ``wf8a16`` | ``wf8af8`` | ``w8a8`` | ``w4a8-g{32,64,128}`` →
    (config, the modules' scheme)."""
    s = scheme.strip().lower()
    if s == "w8a16":
        return QuantizationConfig.w_i8_a_16(), ModuleScheme("int8", -1, True)
    if s in ("fp8", "wf8a16"):
        return QuantizationConfig.w_f8_a_16(), ModuleScheme("fp8", -1, True)
    if s == "w8a8":  # KV cache unset: it stays fp32, like the activations between the matmuls
        return QuantizationConfig("int8", "int8"), ModuleScheme("int8", -1, True)
    if s == "wf8af8":  # per-token e4m3 activations (fxc::linear_f8f8); the KV cache stays fp32, as for w8a8
        return QuantizationConfig("fp8", "fp8"), ModuleScheme("fp8", -1, True)
    m = re.fullmatch(r"w4a16-g(32|64|128)", s)
    if m:
        return QuantizationConfig.w_4_a_16(), ModuleScheme("int4", int(m.group(1)), False)
    m = re.fullmatch(r"w4a8-g(32|64|128)", s)  # int8 activations per token and group (fxc::linear_w4a8)
    if m:
        return QuantizationConfig("int4", "int8"), ModuleScheme("int4", int(m.group(1)), False)
    if s in _KV_SCHEMES:
        raise ValueError(f"{s} is a KV-cache scheme, not a weight scheme: quantize_model(..., {s!r}) or "
                         f"'<weight scheme>+{s}' (split_scheme)")
    raise ValueError(f"--scheme must be {_BUILT}, got {scheme!r}")


def _linear_modules(config) -> list[str]:
    """Names of the model's nn.Linear modules except the output projection (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out_emb = model.get_output_embeddings()
    names = [n for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear) and mod is not out_emb]
    if not names:
        raise NotImplementedError(f"model type {config.model_type!r} has no nn.Linear projections (e.g. GPT-2's "
                                  "Conv1D); the quantize pass rewrites transposed linear weights only")
    return names


def _load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weights to quantize")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _rtn(w: torch.Tensor, scheme: ModuleScheme, observer: str = "minmax") -> dict[str, torch.Tensor]:
    """RTN codes and scales of one ``[N, K]`` weight (the quantize pass's own rounding; another observer than
    ``minmax``: :func:`fxcompiler.gptq.rtn_quantize_weight`'s grids)."""
    from .ops.quant_linear import quantize_linear_weight_int4, unpack_int4

    if observer != "minmax":
        from .gptq import rtn_quantize_weight

        return rtn_quantize_weight(w, scheme, observer)
    w = w.detach().to(torch.float32)
    n, k = w.shape
    if scheme.weight == "fp8":
        from .ops.quant_linear import quantize_fp8_codes

        q, s = quantize_fp8_codes(w)
        return {"weight_scale": s, "qweight": q}
    if scheme.weight == "int8":
        amax = w.abs().amax(dim=1, keepdim=True)
        s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        return {"weight_scale": s, "qweight": torch.clamp(torch.round(w / s), -127, 127).to(torch.int8)}
    packed, s, m = quantize_linear_weight_int4(w, scheme.group_size, scheme.symmetric)
    q, s, m = unpack_int4(packed, s, m, n)
    out = {"weight_scale": s.contiguous(), "qweight": q.contiguous()}
    if not scheme.symmetric:
        out["weight_min"] = m.contiguous()
    return out


def quantize_model(model: str, out: str | os.PathLike, scheme: str, *, algorithm: str = "rtn",
                   calib_data: str | os.PathLike | None = None, num_samples: int = 128, seq_len: int = 512,
                   seed: int = 0, cache_dir: str | os.PathLike | None = None, progress: bool = True,
                   gptq: "GPTQConfig | None" = None, observer: str = "minmax", smoothquant_alpha: float = 0.5,
                   kv_calib_tokens: int | None = None, kv_observer: str = "minmax",
                   kv_percentile: float | None = None) -> Path:
    """Quantize ``model`` (id, HF directory or .gguf) into the directory ``out``; returns it
    (``gptq``: GPTQ's damping / block size / act order / observer / refit, defaults 0.01 / 128 / off / minmax /
    off; ``observer``: the weight observer of RTN, :mod:`fxcompiler.weight_observer`; ``smoothquant_alpha``: the
    migration strength of ``algorithm="smoothquant"``, in (0, 1]; ``kv_calib_tokens``: tokens the KV8 / KVf8 scales
    are calibrated on, default :data:`~fxcompiler.kv_cache_quant.DEFAULT_CALIBRATION_TOKENS`; ``kv_observer``:
    ``minmax`` (absmax) or ``percentile`` (``kv_percentile``, default
    :data:`~fxcompiler.kv_cache_quant.DEFAULT_PERCENTILE`, of |x| per layer and KV head))."""
    from .calibration import text_digest
    from .kv_cache_quant import DEFAULT_CALIBRATION_TOKENS, check_kv_observer
    from .models.loader import load_config, model_directory
    from .models.sources import resolve_model_source

    weight_scheme, kv_dtype = split_scheme(scheme)
    kv_name = {"int8": "kv8", "fp8": "kvf8", None: "kv8 / kvf8"}[kv_dtype]
    if kv_calib_tokens is None:
        kv_calib_tokens = DEFAULT_CALIBRATION_TOKENS
    if isinstance(kv_calib_tokens, bool) or not isinstance(kv_calib_tokens, int) or kv_calib_tokens <= 0:
        raise ValueError(f"--kv-calib-tokens must be a positive int, got {kv_calib_tokens!r}")
    if kv_dtype is None and kv_calib_tokens != DEFAULT_CALIBRATION_TOKENS:
        raise ValueError(f"--kv-calib-tokens applies to the kv8 / kvf8 schemes, got --scheme {scheme}")
    kv_observer, kv_percentile = check_kv_observer(kv_observer, kv_percentile)
    if kv_dtype is None and (kv_observer != "minmax" or kv_percentile is not None):
        raise ValueError(f"--kv-observer / --kv-percentile apply to the kv8 / kvf8 schemes, got --scheme {scheme}")
    kv_calib = (kv_calib_tokens, kv_observer, kv_percentile)
    if weight_scheme is None:
        if algorithm != "rtn":
            raise ValueError(f"--algorithm {algorithm} quantizes weights; --scheme {kv_name} quantizes only the KV "
                             f"cache (use e.g. --scheme w8a16+{kv_name})")
        return _quantize_kv_only(model, Path(out), calib_data, kv_dtype, kv_calib, cache_dir)
    config_q, module_scheme = parse_scheme(weight_scheme)
    if algorithm not in ("rtn", "gptq", "smoothquant"):
        raise ValueError(f"--algorithm must be rtn, gptq or smoothquant, got {algorithm!r}")
    if algorithm == "smoothquant":
        if config_q.activation.value != "int8":
            raise ValueError(f"--algorithm smoothquant needs int8 activations (--scheme w8a8), got --scheme {scheme}")
        if config_q.weight.value != "int8":
            raise ValueError(f"--algorithm smoothquant is built for int8 weights per channel (--scheme w8a8), got "
                             f"--scheme {scheme}")
        from .smoothquant import check_alpha

        smoothquant_alpha = check_alpha(smoothquant_alpha)
    from .gptq import GPTQConfig

    from .weight_observer import check_observer

    check_observer(observer, "--w-observer")
    gptq = gptq if gptq is not None else GPTQConfig(observer=observer)
    for name, v in (("num_samples", num_samples), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive int, got {v!r}")
    out = Path(out)
    _check_output_is_empty(out)
    calib_text, calib_source = _calibration(calib_data)
    source = resolve_model_source(model)
    model_dir = Path(model_directory(source, cache_dir))
    config = load_config(model_dir, {}, False)
    modules = _linear_modules(config)
    weights = _load_weights(model_dir)
    missing = [m for m in modules if f"{m}.weight" not in weights]
    if missing:
        raise ValueError(f"{model_dir}: linear weights missing from the checkpoint, e.g. {missing[0]}.weight")
    torch.manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    calib = {"source": calib_source, "sha256": text_digest(calib_text), "num_samples": num_samples,
             "seq_len": seq_len, "read": algorithm != "rtn"}
    if algorithm == "gptq":
        weights = None  # GPTQ works on the eager model's own weights
        result, how = _gptq(model_dir, config, calib_text, modules, module_scheme, gptq, num_samples, seq_len, seed,
                            progress)
        tensors = result.tensors
        calib["tokenized"] = how
        ratios = [v["gptq"] / v["rtn"] for v in result.stats.values() if v["rtn"] > 0]
        algo_record = {"damp": gptq.damp, "block_size": gptq.block_size, "act_order": gptq.act_order,
                       "observer": gptq.observer, "refit": gptq.refit,
                       "sequential": "decoder layer by decoder layer" + (", then linears fed the same input"
                                                                         if gptq.true_sequential else ""),
                       "hessian_error_vs_rtn_mean": sum(ratios) / len(ratios) if ratios else None}
    elif algorithm == "smoothquant":
        tensors, smoothed, how = _smoothquant(model_dir, config, calib_text, modules, module_scheme, num_samples,
                                              seq_len, seed, smoothquant_alpha, observer)
        calib["tokenized"] = how
        algo_record = {"alpha": smoothquant_alpha, "observer": observer, "smoothed_modules": sum(
            1 for m in modules if not bool(torch.all(tensors[f"{m}.smooth_factor"] == 1))),
            "folded": "1/s into input_layernorm (q/k/v), post_attention_layernorm (gate/up), v_proj's rows "
                      "(o_proj, shared per KV head) and up_proj's rows (down_proj)"}
    else:
        bar = _progress(modules, progress)
        for m in bar:
            for suffix, t in _rtn(weights[f"{m}.weight"], module_scheme, observer).items():
                tensors[f"{m}.{suffix}"] = t
        calib["note"] = "RTN reads no calibration data; the hash records what a calibrating algorithm would read"
        algo_record = {"observer": observer}
    with _staged(out) as stage:
        for f in model_dir.iterdir():
            if f.is_file() and f.name not in (QFORMAT_FILE, QPARAM_FILE, RECIPE_FILE):
                shutil.copy2(f, stage / f.name)
        if algorithm == "smoothquant":
            _rewrite_weights(stage, smoothed)
        sq_meta = {"smoothquant_alpha": str(smoothquant_alpha)} if algorithm == "smoothquant" else {}
        w_observer = gptq.observer if algorithm == "gptq" else observer
        write_qformat(stage / QFORMAT_FILE, config_q, module_scheme, {},
                      {"weight_calib_method": _calib_method(module_scheme, w_observer), "algorithm": algorithm,
                       **({"gptq_damp": str(gptq.damp)} if algorithm == "gptq" else {}), **sq_meta})
        save_qparam(stage / QPARAM_FILE, tensors, {"scheme": scheme, "algorithm": algorithm, **sq_meta,
                                                   **({"gptq_damp": str(gptq.damp)} if algorithm == "gptq" else {})})
        recipe = {"scheme": scheme, "config": str(config_q), "algorithm": algorithm, "seed": seed,
                  "module_scheme": module_scheme.to_dict(), "modules": len(modules), "source_model": source.model_id,
                  "calibration": calib, ("gptq" if algorithm == "gptq" else "smoothquant" if algorithm == "smoothquant"
                                         else "rtn"): algo_record,
                  "qformat_sha256": qparam_digest(stage / QFORMAT_FILE),
                  "qparam_sha256": qparam_digest(stage / QPARAM_FILE)}
        if kv_dtype is not None:
            recipe["kv_cache"] = _write_kv_scales(stage, calib_text, calib_source, kv_dtype, kv_calib, cache_dir)
        (stage / RECIPE_FILE).write_text(json.dumps(recipe, indent=1) + "\n")
    return out


@contextlib.contextmanager
def _staged(out: Path):
    """A temporary sibling of ``out`` to write the model directory into, renamed to ``out`` when the
    block succeeds and removed when it fails: an interrupted run never leaves a half-written ``out``
    that ``LLM(out)`` would load (a killed one leaves only ``.OUT.partial-*``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    stage.mkdir()  # the umask's mode, as out itself would get
    try:
        yield stage
        if out.exists():
            out.rmdir()  # checked empty before the work began
        os.replace(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _check_output_is_empty(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output directory {str(out)!r} exists and is not empty")


def _calibration(calib_data) -> tuple[str, str]:
    """The calibration text and where it came from (``--calib-data`` or the built-in pydoc text)."""
    from .calibration import calibration_text

    if calib_data is not None:
        return Path(calib_data).read_text(encoding="utf-8"), os.fspath(calib_data)
    return calibration_text(), "pydoc_data.topics (even-indexed topics by name)"


def _quantize_kv_only(model: str, out: Path, calib_data, kv_dtype: str, kv_calib: tuple, cache_dir) -> Path:
    """``--scheme kv8`` / ``kvf8``: OUT = the model's files + ``kv_cache_scales.json`` + the recipe."""
    from .models.loader import model_directory
    from .models.sources import resolve_model_source

    _check_output_is_empty(out)
    calib_text, calib_source = _calibration(calib_data)
    source = resolve_model_source(model)
    model_dir = Path(model_directory(source, cache_dir))
    with _staged(out) as stage:
        for f in model_dir.iterdir():
            if f.is_file() and f.name not in (RECIPE_FILE,):
                shutil.copy2(f, stage / f.name)
        name, config_name = {"int8": ("kv8", "KV8"), "fp8": ("kvf8", "KVf8")}[kv_dtype]
        recipe = {"scheme": name, "config": config_name, "source_model": source.model_id,
                  "kv_cache": _write_kv_scales(stage, calib_text, calib_source, kv_dtype, kv_calib, cache_dir)}
        (stage / RECIPE_FILE).write_text(json.dumps(recipe, indent=1) + "\n")
    return out


def _write_kv_scales(out: Path, text: str, source: str, kv_dtype: str, kv_calib: tuple, cache_dir) -> dict:
    """Calibrate KV8 / KVf8 scales (``kv_calib``: tokens, observer, percentile) on the model in ``out`` (float
    cache) and write ``kv_cache_scales.json``; the recipe record."""
    from .calibration import text_digest
    from .kv_cache_quant import DEFAULT_MARGIN, KV_QMAX, KV_SCALES_FILE, quantize_kv_cache, save_kv_scales
    from .llm import LLM
    from .models.loader import load_config
    from .config import ManualBucketConfig

    num_tokens, observer, percentile = kv_calib
    config = load_config(out, {}, False)
    window = min(512, int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 512)))
    # one prefill bucket of the calibration window: the build is for calibration only
    with LLM(str(out), kv_cache_dtype="auto", cache_dir=cache_dir, max_seq_len_to_capture=window,
             bucket_config=ManualBucketConfig(prefill_buckets=[(1, window)], decode_buckets=[(1, window)])) as llm:
        k, v = quantize_kv_cache(llm, text, num_tokens=num_tokens, kv_dtype=kv_dtype, observer=observer,
                                 percentile=percentile)
    record = {"dtype": kv_dtype, "file": KV_SCALES_FILE, "granularity": "per layer, per KV head (static)",
              "observer": observer, **({"percentile": percentile} if observer == "percentile" else {}),
              "margin": DEFAULT_MARGIN, "qmax": KV_QMAX[kv_dtype],
              "calibration": {"source": source, "sha256": text_digest(text), "num_tokens": num_tokens,
                              "max_seq_len": window}}
    save_kv_scales(out, k, v, {"recipe": record}, kv_dtype=kv_dtype)
    return record


def _calib_method(scheme: ModuleScheme, observer: str) -> str:
    """The qformat line's ``weight_calib_method``: AMAX_SYM / MINMAX_ASYM, MSE_SYM / MSE_ASYM with ``--w-observer mse``
    (int8 is amax/127 whatever the observer)."""
    if scheme.weight == "int8" or observer == "minmax":
        return "AMAX_SYM" if scheme.weight in ("int8", "fp8") else "MINMAX_ASYM"
    return "MSE_SYM" if scheme.weight == "fp8" or scheme.symmetric else "MSE_ASYM"


def _gptq(model_dir: Path, config, text: str, modules: list[str], scheme: ModuleScheme, gptq, num_samples: int,
          seq_len: int, seed: int, progress: bool):
    """GPTQ over the eager fp32 transformers model on the calibration windows."""
    from .gptq import gptq_quantize_model

    model, samples, how = _calibration_model(model_dir, config, text, num_samples, seq_len, seed)
    return gptq_quantize_model(model, samples, modules, scheme, gptq, progress=progress), how



def _calibration_model(model_dir: Path, config, text: str, num_samples: int, seq_len: int, seed: int):
    """The eager fp32 model and its calibration samples: ``(model, samples, how the text was tokenized)``."""
    import warnings

    from transformers import AutoModelForCausalLM

    from .calibration import calibration_samples
    from .models.loader import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    samples, how = calibration_samples(text, tokenizer, config.vocab_size, num_samples, seq_len, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    return model.eval(), samples, how

def _smoothquant(model_dir: Path, config, text: str, modules: list[str], scheme: ModuleScheme, num_samples: int,
                 seq_len: int, seed: int, alpha: float, observer: str):
    """SmoothQuant on the eager fp32 model, then RTN of the smoothed weights: ``(qparam tensors, the float
    tensors it changed {checkpoint name: tensor}, how the calibration text was tokenized)``."""
    from .smoothquant import smooth_model

    model, samples, how = _calibration_model(model_dir, config, text, num_samples, seq_len, seed)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    factors = smooth_model(model, samples, alpha)
    mods = dict(model.named_modules())
    tensors: dict[str, torch.Tensor] = {}
    for m in modules:
        w = mods[m].weight.detach()
        for suffix, t in _rtn(w, scheme, observer).items():
            tensors[f"{m}.{suffix}"] = t
        tensors[f"{m}.smooth_factor"] = factors.get(m, torch.ones(w.shape[1])).contiguous()
    # the float tensors smoothing changed (norm weights, smoothed columns, v_proj/up_proj rows and biases)
    changed = {n: p.detach().clone() for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    return tensors, changed, how


def _rewrite_weights(out: Path, changed: dict[str, torch.Tensor]) -> None:
    """Replace ``changed`` tensors in OUT's copied safetensors (dtype kept); every name must be found."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    left = set(changed)
    for f in sorted(out.glob("*.safetensors")):
        if f.name == QPARAM_FILE:
            continue
        with safe_open(str(f), "pt") as h:
            meta = h.metadata()
            names = list(h.keys())
            hit = [n for n in names if n in changed]
            if not hit:
                continue
            tensors = {n: h.get_tensor(n) for n in names}
        for n in hit:
            tensors[n] = changed[n].to(tensors[n].dtype).contiguous()
            left.discard(n)
        save_file(tensors, str(f), metadata=meta)
    if left:
        raise ValueError(f"SmoothQuant: smoothed tensors not found in the checkpoint, e.g. {sorted(left)[0]!r}")


def _progress(items, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm ships with huggingface_hub
        return items
    return tqdm(items, desc="quantize", unit="module", file=sys.stderr, disable=not enabled)
