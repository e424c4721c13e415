"""``EngineArgs``: every engine option in one dataclass, shared by ``LLM``, the CLI and the server.

vLLM's shape (``vllm/engine/arg_utils.py``): one dataclass whose fields are the engine's
options, ``add_cli_args`` that derives argparse flags from it (field ``max_seq_len_to_capture``
→ ``--max-seq-len-to-capture``, plus furiosa's short flags ``-tp/-pp/-dp/-pb/-db``),
``from_cli_args`` that reads them back, and validation that names the argument. ``llm_kwargs()``
is the mapping onto ``LLM(...)`` / ``LLM.load_artifact(...)``; ``create_llm()`` builds it (an
artifact directory is recognised by its ``artifact.json``).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

__all__ = ["EngineArgs"]

_ARTIFACT_MANIFEST = "artifact.json"


def _pos_int(name: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def bucket_pair(text: str) -> tuple[int, int]:
    """argparse type of a ``BATCH,ATTENTION`` bucket flag (``-pb`` / ``-db``)."""
    try:
        b, a = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCH,ATTENTION (two integers), got {text!r}") from None
    return b, a


@dataclass
class EngineArgs:
    """Options of one engine (model, compilation, KV cache, scheduler); see ``add_cli_args`` for help texts."""

    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    task_type: str | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None
    tokenizer_mode: Literal["auto", "slow"] = "auto"
    trust_remote_code: bool = False
    seed: int | None = None
    devices: str | None = None
    dtype: str = "auto"
    max_seq_len_to_capture: int = 2048
    max_prompt_len: int | None = None
    prefill_chunk_size: int | None = None
    prefill_buckets: list[tuple[int, int]] = field(default_factory=list)
    decode_buckets: list[tuple[int, int]] = field(default_factory=list)
    enable_prefix_caching: bool = True
    paged_attention_block_size: int = 16
    paged_attention_num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    comp_supertask_kind: Literal["fx", "dfg", "edf"] | None = None
    auto_bfloat16_cast: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int | None = None
    npu_queue_limit: int = 2
    max_processing_samples: int = 65536
    spare_blocks_ratio: float = 0.0
    is_offline: bool = False
    use_random_weight: bool = False
    num_pipeline_builder_workers: int = 1
    num_compile_workers: int = 1
    cache_dir: str | None = None
    compile_in_subprocess: bool = False
    threads: int | None = None
    quantization: str | None = None
    quantization_group_size: int | None = None
    keep_gguf_quantization: bool = False
    quantize_lm_head: bool | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    speculative_model_quantization: str | None = None

    _HELP = {
        "model": "model id, HF-format directory, .gguf file or artifact directory (fxcompiler build)",
        "task_type": "embed (an embedding model: /v1/embeddings) or score (a cross-encoder: /v1/score, /v1/rerank); "
                     "default: what the checkpoint's class is (docs/encoder-tasks.md)",
        "served_model_name": "the model name the server reports and accepts (default: the model id)",
        "tokenizer": "tokenizer name or path (default: the model's)",
        "devices": "cpu, cuda or cuda:N",
        "dtype": "auto, float32, bfloat16 or float64",
        "max_prompt_len": "longest prompt (default: max_seq_len_to_capture)",
        "prefill_buckets": "a prefill bucket BATCH,ATTN (repeatable; default: the automatic ladder)",
        "decode_buckets": "a decode bucket BATCH,ATTN (repeatable)",
        "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
        "paged_attention_num_blocks": "KV-cache blocks (default: planned from memory)",
        "kv_cache_memory_bytes": "KV-cache memory budget in bytes",
        "kv_cache_dtype": "auto (the model's dtype; the file's dtype for a directory with kv_cache_scales.json), "
                          "int8 or fp8 / fp8_e4m3 (static per-layer per-KV-head scales; docs/quantization.md KV8, KVf8)",
        "auto_bfloat16_cast": "bf16 weights, compute and KV cache",
        "npu_queue_limit": "engine steps in flight before their outputs are consumed",
        "max_processing_samples": "cap on sequences processed concurrently",
        "spare_blocks_ratio": "fraction of KV blocks held back when admitting prompts",
        "is_offline": "throughput mode (admit as many prompts as fit before decoding)",
        "use_random_weight": "random weights (no checkpoint; for tests and benchmarks)",
        "cache_dir": "build/conversion cache (default ~/.cache/fxcompiler)",
        "compile_in_subprocess": "on a compile-cache miss, export and optimise the model in a child process and "
                                 "load the cached program (a cold start then ends with a warm start's memory)",
        "threads": "torch intra-op threads (default: all cores)",
        "quantization": "quantize the weights while building: a scheme string such as W8A16, W4A16, W8A8, W4A8, "
                        "Wf8A16, W16A16, W8A16KV8 (docs/quantization.md)",
        "quantization_group_size": "int4: 32, 64 or 128 (default 128); int8: -1 per channel (default) or a divisor of K",
        "keep_gguf_quantization": "run a GGUF (e.g. the embedded Q4_1 default) on its own Q4_0/Q4_1/Q4_K/Q8_0/Q5_0/Q6_K "
                                  "blocks, not dequantised",
        "quantize_lm_head": "also quantize lm_head (default: on a GGUF's own blocks with --keep-gguf-quantization, "
                            "else float)",
        "speculative_model": "a draft model (id, directory, .gguf) or '[ngram]' ('[ngram]:MIN:MAX') for speculative "
                             "decoding (docs/speculative.md)",
        "num_speculative_tokens": "draft tokens proposed per step (with --speculative-model)",
        "speculative_model_quantization": "quantize the draft model while building it, e.g. W8A16 or W4A8 with "
                                          "--speculative-model set to the target itself: a quantized copy drafts "
                                          "losslessly (docs/speculative.md)",
    }
    _SHORT = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp", "data_parallel_size": "-dp",
              "prefill_buckets": "-pb", "decode_buckets": "-db"}
    # earlier spellings of the CLI's own flags, and vLLM's names of the same options
    _ALIASES = {"devices": ["--device"], "prefill_buckets": ["--prefill-bucket"], "decode_buckets": ["--decode-bucket"],
                "max_seq_len_to_capture": ["--max-model-len"], "max_processing_samples": ["--max-num-seqs"],
                "paged_attention_block_size": ["--block-size"]}

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)) or not str(self.model):
            raise ValueError(f"model must be a non-empty str, got {self.model!r}")
        self.model = os.fspath(self.model)
        if self.task_type is not None:
            from .encoder_tasks import TASK_NAMES

            if self.task_type not in TASK_NAMES:
                raise ValueError(f"task_type={self.task_type!r} is not a task fxcompiler knows; expected one of "
                                 f"{sorted(TASK_NAMES)}")
        if self.tokenizer_mode not in ("auto", "slow"):
            raise ValueError(f"tokenizer_mode must be 'auto' or 'slow', got {self.tokenizer_mode!r}")
        if self.comp_supertask_kind not in (None, "fx", "dfg", "edf"):
            raise ValueError(f"comp_supertask_kind must be 'fx', 'dfg' or 'edf', got {self.comp_supertask_kind!r}")
        for name in ("max_seq_len_to_capture", "paged_attention_block_size", "tensor_parallel_size",
                     "pipeline_parallel_size", "npu_queue_limit", "max_processing_samples",
                     "num_pipeline_builder_workers", "num_compile_workers"):
            _pos_int(name, getattr(self, name))
        for name in ("max_prompt_len", "prefill_chunk_size", "data_parallel_size", "threads",
                     "kv_cache_memory_bytes", "num_speculative_tokens"):
            _pos_int(name, getattr(self, name), allow_none=True)
        if self.quantization_group_size is not None and (isinstance(self.quantization_group_size, bool) or not
                                                         isinstance(self.quantization_group_size, int)):
            raise ValueError(f"quantization_group_size must be an int, got {self.quantization_group_size!r}")
        for name in ("quantization", "speculative_model_quantization"):
            if getattr(self, name) is not None:
                from .quant_config import QuantizationConfig

                try:
                    QuantizationConfig.from_str(getattr(self, name))
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{name}: {exc}") from None
        if self.speculative_model_quantization is not None and self.speculative_model is None:
            raise ValueError("speculative_model_quantization needs speculative_model (the draft it quantizes)")
        if self.quantize_lm_head is not None and not isinstance(self.quantize_lm_head, bool):
            raise TypeError(f"quantize_lm_head must be a bool or None, got {self.quantize_lm_head!r}")
        if self.num_speculative_tokens is not None and self.speculative_model is None and not self.is_artifact:
            raise ValueError("num_speculative_tokens needs speculative_model")
        if self.is_artifact:
            given = [n for n in ("quantization", "quantization_group_size", "quantize_lm_head",
                                 "speculative_model_quantization", "task_type")
                     if getattr(self, n) is not None] + (["keep_gguf_quantization"] if self.keep_gguf_quantization
                                                         else [])
            if given:
                raise ValueError(f"{', '.join(given)}: an artifact runs the task and quantization it was built "
                                 f"with ({self.model}); these options apply when building from a model")
        _pos_int("paged_attention_num_blocks", self.paged_attention_num_blocks, allow_none=True, minimum=2)
        from .kv_cache_quant import parse_kv_cache_dtype

        self.kv_cache_dtype = parse_kv_cache_dtype(self.kv_cache_dtype)
        if self.max_prompt_len is not None and self.max_prompt_len > self.max_seq_len_to_capture:
            raise ValueError(f"max_prompt_len={self.max_prompt_len} exceeds "
                             f"max_seq_len_to_capture={self.max_seq_len_to_capture}")
        if isinstance(self.spare_blocks_ratio, bool) or not isinstance(self.spare_blocks_ratio, (int, float)) \
                or not 0.0 <= self.spare_blocks_ratio < 1.0:
            raise ValueError(f"spare_blocks_ratio must be in [0, 1), got {self.spare_blocks_ratio!r}")
        if bool(self.prefill_buckets) != bool(self.decode_buckets) and not self.is_artifact:
            raise ValueError("give both prefill_buckets and decode_buckets (-pb/--prefill-buckets and "
                             "-db/--decode-buckets), or neither")
        for name in ("prefill_buckets", "decode_buckets"):
            pairs = [tuple(p) for p in getattr(self, name)]
            for p in pairs:
                if len(p) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in p):
                    raise ValueError(f"{name} entries must be (batch, attention) pairs of positive ints, got {p!r}")
            setattr(self, name, pairs)
        for name in ("trust_remote_code", "enable_prefix_caching", "auto_bfloat16_cast", "is_offline",
                     "use_random_weight", "compile_in_subprocess", "keep_gguf_quantization"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    # -- derived ----------------------------------------------------------------------------------
    @property
    def is_artifact(self) -> bool:
        """Whether ``model`` names an artifact directory (built by ``fxcompiler build``)."""
        return (Path(self.model) / _ARTIFACT_MANIFEST).is_file()

    @property
    def model_name(self) -> str:
        """The name clients use for this model."""
        return self.served_model_name or self.model

    def scheduler_config(self):
        from .config import SchedulerConfig

        return SchedulerConfig(npu_queue_limit=self.npu_queue_limit,
                               max_processing_samples=self.max_processing_samples,
                               spare_blocks_ratio=float(self.spare_blocks_ratio), is_offline=self.is_offline)

    def bucket_config(self):
        from .config import ManualBucketConfig

        if not self.prefill_buckets and not self.decode_buckets:
            return None
        return ManualBucketConfig(self.prefill_buckets, self.decode_buckets or None)

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``LLM(...)`` (or of ``LLM.load_artifact`` for an artifact), without ``model``."""
        from .llm import CACHE_DIR

        common: dict[str, Any] = dict(
            devices=self.devices, seed=self.seed, tokenizer=self.tokenizer, tokenizer_mode=self.tokenizer_mode,
            cache_dir=self.cache_dir or CACHE_DIR, scheduler_config=self.scheduler_config(),
            bucket_config=self.bucket_config(), enable_prefix_caching=self.enable_prefix_caching,
            paged_attention_num_blocks=self.paged_attention_num_blocks,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes)
        if self.kv_cache_dtype != "auto":
            common["kv_cache_dtype"] = self.kv_cache_dtype
        if self.speculative_model is not None:
            common["speculative_model"] = self.speculative_model
        if self.num_speculative_tokens is not None:
            common["num_speculative_tokens"] = self.num_speculative_tokens
        if self.speculative_model_quantization is not None:
            from .config import LLMConfig
            from .quant_config import QuantizationConfig

            common["speculative_model_llm_config"] = LLMConfig(
                quantization_config=QuantizationConfig.from_str(self.speculative_model_quantization))
        if self.is_artifact:
            common.update(pipeline_parallel_size=None if self.pipeline_parallel_size == 1
                          else self.pipeline_parallel_size, data_parallel_size=self.data_parallel_size)
            return common
        if self.task_type is not None:
            common["task_type"] = self.task_type
        common.update(
            dtype=self.dtype, trust_remote_code=self.trust_remote_code,
            max_seq_len_to_capture=self.max_seq_len_to_capture, max_prompt_len=self.max_prompt_len,
            prefill_chunk_size=self.prefill_chunk_size, paged_attention_block_size=self.paged_attention_block_size,
            comp_supertask_kind=self.comp_supertask_kind, auto_bfloat16_cast=self.auto_bfloat16_cast or None,
            tensor_parallel_size=self.tensor_parallel_size, pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size, use_random_weight=self.use_random_weight,
            num_pipeline_builder_workers=self.num_pipeline_builder_workers,
            num_compile_workers=self.num_compile_workers)
        if self.compile_in_subprocess:
            common["compile_in_subprocess"] = True
        common.update(self.quantization_kwargs())
        return common

    def quantization_kwargs(self) -> dict[str, Any]:
        """The quantization options as ``LLM(...)`` keyword arguments (``llm_config`` for a scheme string)."""
        kw: dict[str, Any] = {}
        if self.quantization is not None:
            from .config import LLMConfig
            from .quant_config import QuantizationConfig

            kw["llm_config"] = LLMConfig(quantization_config=QuantizationConfig.from_str(self.quantization))
        if self.quantization_group_size is not None:
            kw["quantization_group_size"] = self.quantization_group_size
        if self.keep_gguf_quantization:
            kw["keep_gguf_quantization"] = True
        if self.quantize_lm_head is not None:
            kw["quantize_lm_head"] = self.quantize_lm_head
        return kw

    def set_threads(self) -> None:
        """Apply ``threads`` (torch's intra-op thread count) to this process."""
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)

    def create_llm(self):
        """Build (or load) the ``LLM`` these arguments describe."""
        from .llm import LLM

        self.set_threads()
        if self.is_artifact:
            return LLM.load_artifact(self.model, **self.llm_kwargs())
        return LLM(self.model, **self.llm_kwargs())

    # -- command line -----------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, positional_model: bool = False
                     ) -> argparse.ArgumentParser:
        """Add one ``--flag`` per field (``--no-X`` for booleans that default to True)."""
        defaults = cls()
        for f in fields(cls):
            if f.name.startswith("_"):
                continue
            flag = "--" + f.name.replace("_", "-")
            names = [flag] + ([cls._SHORT[f.name]] if f.name in cls._SHORT else []) + cls._ALIASES.get(f.name, [])
            default = getattr(defaults, f.name)
            help_text = cls._HELP.get(f.name, "")
            if f.name == "model":
                if positional_model:
                    parser.add_argument("model", metavar="MODEL_OR_ARTIFACT", help=help_text)
                else:
                    parser.add_argument("--model", "-m", default=default, help=help_text)
                continue
            if f.name in ("prefill_buckets", "decode_buckets"):
                parser.add_argument(*names, dest=f.name, type=bucket_pair, action="append", default=[],
                                    metavar="BATCH,ATTN", help=help_text)
            elif isinstance(default, bool) or f.name == "quantize_lm_head":
                parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                    help=help_text)
            elif f.name == "comp_supertask_kind":
                parser.add_argument(*names, dest=f.name, choices=["fx", "dfg", "edf"], default=None)
            elif f.name == "tokenizer_mode":
                parser.add_argument(*names, dest=f.name, choices=["auto", "slow"], default=default)
            else:
                kind = {"int": int, "float": float}.get(_base_type(f.type), str)
                parser.add_argument(*names, dest=f.name, type=kind, default=default, help=help_text)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The ``EngineArgs`` in a namespace parsed with ``add_cli_args`` (other attributes ignored)."""
        names = [f.name for f in fields(cls) if not f.name.startswith("_")]
        return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})

    def replace(self, **changes) -> "EngineArgs":
        return dataclasses.replace(self, **changes)


def _base_type(annotation: Any) -> str:
    """'int' / 'float' / 'str' for annotations such as ``int | None`` (written as strings here)."""
    text = str(annotation)
    for name in ("int", "float"):
        if text == name or text.startswith(name + " ") or text.startswith(name + "|"):
            return name
    return "str"
