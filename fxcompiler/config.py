"""User-facing configuration records (furiosa-llm names and meanings, validated on construction)."""
from __future__ import annotations

import enum
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from .pipeline import Bucket


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass
class SchedulerConfig:
    """Scheduler knobs with their furiosa meaning.

    * ``npu_queue_limit``: engine steps that may be in flight (run, results not yet
      consumed) at once; the engine's worker thread stalls beyond it (runtime/driver.py).
    * ``max_processing_samples``: cap on sequences being processed concurrently.
    * ``spare_blocks_ratio``: fraction of KV blocks held back when admitting new prompts.
    * ``is_offline``: throughput mode (admit as many prompts as fit before decoding).
    * ``prefill_chunk_size``: deprecated here; use ``LLM(prefill_chunk_size=...)``.
    """

    npu_queue_limit: int = 2
    max_processing_samples: int = 65536
    spare_blocks_ratio: float = 0.0
    is_offline: bool = False
    prefill_chunk_size: int | None = None

    def __post_init__(self):
        _positive_int("SchedulerConfig.npu_queue_limit", self.npu_queue_limit)
        _positive_int("SchedulerConfig.max_processing_samples", self.max_processing_samples)
        if not isinstance(self.spare_blocks_ratio, (int, float)) or not 0.0 <= self.spare_blocks_ratio < 1.0:
            raise ValueError(f"SchedulerConfig.spare_blocks_ratio must be in [0, 1), got {self.spare_blocks_ratio!r}")
        if self.prefill_chunk_size is not None:
            _positive_int("SchedulerConfig.prefill_chunk_size", self.prefill_chunk_size)

    def __eq__(self, other):
        if not isinstance(other, SchedulerConfig):
            return NotImplemented
        return (self.npu_queue_limit == other.npu_queue_limit
                and self.max_processing_samples == other.max_processing_samples
                and abs(self.spare_blocks_ratio - other.spare_blocks_ratio) < 1e-6
                and self.is_offline == other.is_offline)

    def export(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SchedulerConfig":
        with open(path) as f:
            return cls(**json.load(f))


class BucketConfig:
    """Policy that yields the prefill and decode buckets of an LLM."""

    def buckets(self, max_prompt_len: int, max_seq_len: int) -> tuple[list[Bucket], list[Bucket]]:
        raise NotImplementedError


def _pairs(name: str, value) -> list[tuple[int, int]]:
    out = []
    for item in value:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(f"{name} entries must be (batch_size, attention_size) pairs, got {item!r}")
        b, a = item
        _positive_int(f"{name} batch_size", b)
        _positive_int(f"{name} attention_size", a)
        out.append((int(b), int(a)))
    return out


@dataclass
class ManualBucketConfig(BucketConfig):
    """Explicit ``(batch_size, attention_size)`` buckets for each phase."""

    prefill_buckets: Sequence[tuple[int, int]]
    decode_buckets: Sequence[tuple[int, int]] | None = None

    def __post_init__(self):
        self.prefill_buckets = list(dict.fromkeys(_pairs("prefill_buckets", self.prefill_buckets)))
        if self.decode_buckets is not None:
            self.decode_buckets = list(dict.fromkeys(_pairs("decode_buckets", self.decode_buckets)))

    def buckets(self, max_prompt_len, max_seq_len):
        if not self.decode_buckets:
            raise ValueError("ManualBucketConfig.decode_buckets is required for generative models")
        return ([Bucket.prefill(b, a) for b, a in self.prefill_buckets],
                [Bucket.decode(b, a) for b, a in self.decode_buckets])


@dataclass
class MinimalBucketConfig(BucketConfig):
    """furiosa's minimal policy: one batch-1 prefill bucket and one batch-1 decode bucket."""

    max_seq_len: int

    def __post_init__(self):
        _positive_int("MinimalBucketConfig.max_seq_len", self.max_seq_len, 2)

    def buckets(self, max_prompt_len, max_seq_len):
        return [Bucket.prefill(1, min(max_prompt_len, self.max_seq_len))], [Bucket.decode(1, self.max_seq_len)]


def _ladder(lo: int, hi: int) -> list[int]:
    """lo, 2lo, 4lo, ... up to hi (hi included)."""
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    out.append(hi)
    return sorted(set(out))


def _fine_ladder(lo: int, hi: int) -> list[int]:
    """Prompt lengths a prefill pads to: every 16 up to 256, every 64 up to 1024, then every 256
    (plus ``hi``), so a lone prompt pads by at most ~6% beyond the short range."""
    out = {hi}
    for step, top in ((16, 256), (64, 1024), (256, hi)):
        out.update(range(max(lo, step), min(top, hi) + 1, step))
    return sorted(x for x in out if lo <= x <= hi) or [hi]


@dataclass
class DefaultBucketConfig(BucketConfig):
    """fxcompiler's default: a ladder of buckets, so batching and short prompts pad little.

    Prefill: batch 1, 2, 3, ... ``max_prefill_batch`` × attention every 16 tokens to 256, every 64 to 1024, then every 256, up to ``max_prompt_len``.
    Decode: batch 1, 2, 4, 8, 16, 24, 32, 48, 64, ... ``max_decode_batch`` × ``max_seq_len``.
    (furiosa's default is :class:`MinimalBucketConfig`, i.e. batch 1 only: on an NPU every
    bucket is a separate compiled binary; here fx graphs are shape-dynamic, so a ladder is free.)
    """

    max_prefill_batch: int = 8
    max_decode_batch: int = 256
    min_prefill_attention: int = 16

    def buckets(self, max_prompt_len, max_seq_len):
        pb = list(range(1, self.max_prefill_batch + 1))  # padded prefill rows cost a whole prompt each
        attn = _fine_ladder(min(self.min_prefill_attention, max_prompt_len), max_prompt_len)
        db = sorted({1, 2, 4, 8} | {b for b in range(16, self.max_decode_batch + 1, 8) if b <= 32}
                    | {b for b in range(48, self.max_decode_batch + 1, 16)} | {self.max_decode_batch})
        return ([Bucket.prefill(b, a) for b in pb for a in attn], [Bucket.decode(b, max_seq_len) for b in db])


def resolve_prefill_chunk_size(prefill_chunk_size: int | None, scheduler_chunk_size: int | None,
                               enable_chunked_prefill: bool | None, max_num_batched_tokens: int | None) -> int | None:
    """One chunk size from furiosa's ``LLM(prefill_chunk_size)``, its deprecated
    ``SchedulerConfig.prefill_chunk_size`` and vLLM's ``enable_chunked_prefill`` +
    ``max_num_batched_tokens`` (chunk = the token budget of a step; 512 when not given,
    vLLM's default for chunked prefill). None: no chunking. Conflicting values raise ValueError."""
    if prefill_chunk_size is not None:
        _positive_int("prefill_chunk_size", prefill_chunk_size)
    if max_num_batched_tokens is not None:
        _positive_int("max_num_batched_tokens", max_num_batched_tokens)
    if enable_chunked_prefill is not None and not isinstance(enable_chunked_prefill, bool):
        raise TypeError(f"enable_chunked_prefill must be a bool, got {enable_chunked_prefill!r}")
    if scheduler_chunk_size is not None:
        import warnings

        warnings.warn("SchedulerConfig.prefill_chunk_size is deprecated; pass LLM(prefill_chunk_size=...)",
                      DeprecationWarning, stacklevel=3)
        if prefill_chunk_size is not None and prefill_chunk_size != scheduler_chunk_size:
            raise ValueError(f"prefill_chunk_size={prefill_chunk_size} conflicts with "
                             f"SchedulerConfig.prefill_chunk_size={scheduler_chunk_size}")
    chunk = prefill_chunk_size if prefill_chunk_size is not None else scheduler_chunk_size
    if enable_chunked_prefill is False:
        if chunk is not None:
            raise ValueError(f"enable_chunked_prefill=False conflicts with prefill_chunk_size={chunk}")
        if max_num_batched_tokens is not None:
            raise ValueError("max_num_batched_tokens is the chunk size of chunked prefill; it needs "
                             "enable_chunked_prefill=True (or leave it unset)")
        return None
    if max_num_batched_tokens is not None:
        if chunk is not None and chunk != max_num_batched_tokens:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} conflicts with "
                             f"prefill_chunk_size={chunk}")
        chunk = max_num_batched_tokens
    if enable_chunked_prefill and chunk is None:
        chunk = 512
    return chunk


def chunk_buckets(chunk: int, max_prompt_len: int) -> list[Bucket]:
    """furiosa's chunked-prefill buckets: batch 1, ``attention = i * chunk``, ``kv = (i - 1) * chunk``
    for i = 1 .. max_prompt_len // chunk, plus a remainder bucket ending at ``max_prompt_len``."""
    out = [Bucket(1, i * chunk, (i - 1) * chunk) for i in range(1, max_prompt_len // chunk + 1)]
    if max_prompt_len % chunk:
        out.append(Bucket(1, max_prompt_len, (max_prompt_len // chunk) * chunk))
    return out


@dataclass
class KvCacheSharingAcrossBeamsConfig:
    beam_width: int
    max_new_tokens: int

    def __post_init__(self):
        _positive_int("KvCacheSharingAcrossBeamsConfig.beam_width", self.beam_width)
        _positive_int("KvCacheSharingAcrossBeamsConfig.max_new_tokens", self.max_new_tokens)


@dataclass(frozen=True)
class OptimizationConfig:
    """Model-rewrite flags (furiosa names). The fx pipeline always uses paged attention and
    last-token logits; the other flags select NPU-specific model variants and are recorded only."""

    attention_type: str = "PAGED_ATTENTION"
    optimize_rope: bool = False
    optimize_packed: bool = False
    decompose_layernorm: bool = False
    optimize_furiosa: bool = False
    use_unsplit_packed: bool = False
    compact_causal_mask: bool = False
    use_rngd_gelu: bool = False
    causal_mask_free_decoding: bool = False
    kv_cache_sharing_across_beams: bool = False
    inbound_beamsearch_softmax: bool = False
    calculate_logit_only_for_last_token: bool = True
    optimized_for_speculative_decoding: bool = False


from .quant_config import QDtype, QuantizationConfig  # noqa: E402,F401  (furiosa exports them from here)


@dataclass(frozen=True)
class LLMConfig:
    optimization_config: OptimizationConfig = field(default_factory=OptimizationConfig)
    quantization_config: QuantizationConfig | None = None

    def __post_init__(self):
        if self.quantization_config is not None and not isinstance(self.quantization_config, QuantizationConfig):
            raise TypeError("LLMConfig.quantization_config must be a QuantizationConfig, got "
                            f"{type(self.quantization_config).__name__}")

    def with_quantization_config(self, quantization_config: QuantizationConfig | None) -> "LLMConfig":
        """A copy with ``quantization_config`` replaced (furiosa's method)."""
        return LLMConfig(self.optimization_config, quantization_config)


class LLMBackend(str, enum.Enum):
    """Runtime backends. On CPU/GPU the fx pipeline runner is used; furiosa's NPU names parse
    but are refused (no NPU backend is registered)."""

    TORCH_PIPELINE_RUNNER = "torch_pipeline_runner"
    FURIOSA_RT_NPU = "furiosa_rt_npu"
    FURIOSA_RT_V2 = "furiosa_rt_v2"
    MOCK_BACKEND_V2 = "mock_backend_v2"

    @classmethod
    def parse(cls, value: "LLMBackend | str | None") -> "LLMBackend":
        if value is None:
            return cls.TORCH_PIPELINE_RUNNER
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if value.lower() == member.value or value.upper() == member.name:
                    return member
        raise ValueError(f"backend must be one of {[m.name for m in cls]}, got {value!r}")

    def is_parallelism_supported(self) -> bool:
        return True
