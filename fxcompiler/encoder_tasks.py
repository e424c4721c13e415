"""Encoder task types: their names, how a checkpoint's task is inferred, pooling settings and outputs.

``LLM(model, task_type=...)`` accepts furiosa's / Hugging Face pipeline names and vLLM's:

=====================  ==========================================  ===========================================
task                   ``task_type`` spellings                     API
=====================  ==========================================  ===========================================
question answering     ``"question-answering"``                    ``LLM.bert_forward(prompts, contexts)``
embedding              ``"embed"``, ``"feature-extraction"``,       ``LLM.embed(prompts)``, ``LLM.score`` (cosine)
                       ``"embedding"``
scoring (cross-enc.)   ``"score"``, ``"text-classification"``      ``LLM.score(text_1, text_2)``
text generation        ``None`` / ``"text-generation"`` /          ``generate``, ``chat``, ``stream_generate``
                       ``"generate"``
=====================  ==========================================  ===========================================

With ``task_type=None`` the task comes from the checkpoint's ``architectures`` (furiosa infers it from the
model class): ``*ForQuestionAnswering`` → question answering, ``*ForSequenceClassification`` → scoring, an
encoder's bare ``*Model`` (``BertModel``, ``XLMRobertaModel``) → embedding; everything else generates.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["QA", "EMBED", "SCORE", "GENERATE", "ENCODER_FAMILIES", "PoolerConfig", "PoolingParams",
           "EmbeddingOutput", "EmbeddingRequestOutput", "ScoringOutput", "ScoringRequestOutput",
           "ClassificationOutput", "ClassificationRequestOutput",
           "QuestionAnsweringOutput", "resolve_task", "infer_task", "POOLING_TYPES"]

QA, EMBED, SCORE, GENERATE = "question-answering", "embed", "score", "text-generation"
TASK_NAMES = {
    "question-answering": QA,
    "embed": EMBED, "embedding": EMBED, "feature-extraction": EMBED,
    "score": SCORE, "text-classification": SCORE,
    "text-generation": GENERATE, "generate": GENERATE,
}
ENCODER_TASKS = (QA, EMBED, SCORE)
# transformers model types captured bidirectionally (tests/test_encoder_tasks.py)
ENCODER_FAMILIES = ("bert", "roberta", "xlm-roberta")
POOLING_TYPES = ("CLS", "MEAN", "LAST")


def resolve_task(task_type: str | None, model) -> str:
    """The task of ``LLM(model, task_type=...)``; ``None`` is inferred from the checkpoint (see module doc)."""
    if task_type is None:
        return infer_task(model)
    if not isinstance(task_type, str):
        raise TypeError(f"task_type must be a str or None, got {type(task_type).__name__}")
    if task_type not in TASK_NAMES:
        raise ValueError(f"task_type={task_type!r} is not a task fxcompiler knows; expected one of "
                         f"{sorted(TASK_NAMES)}")
    return TASK_NAMES[task_type]


def _config_json(model) -> dict:
    try:
        from .models.sources import resolve_model_source

        source = resolve_model_source(model)
    except (TypeError, ValueError, OSError):
        return {}  # the generation path reports the bad model argument
    path = Path(source.path)
    if source.kind not in ("hf_dir", "hf_cache") or not (path / "config.json").is_file():
        return {}
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def infer_task(model) -> str:
    """furiosa's default: the task a checkpoint's class serves (``GENERATE`` unless it is an encoder head)."""
    raw = _config_json(model)
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else ""
    if raw.get("model_type") not in ENCODER_FAMILIES:
        return GENERATE
    if arch.endswith("ForQuestionAnswering"):
        return QA
    if arch.endswith("ForSequenceClassification"):
        return SCORE
    if arch.endswith("Model") or not arch:
        return EMBED
    return GENERATE  # e.g. BertForMaskedLM: refused by the generation path with its reason


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's ``PoolerConfig`` (``LLM(..., override_pooler_config=PoolerConfig(pooling_type="MEAN"))``):
    how an embedding model pools its last hidden states and whether it normalises (L2) by default."""

    pooling_type: str | None = None  # CLS | MEAN | LAST; None: the model's default
    normalize: bool | None = None

    def __post_init__(self):
        if self.pooling_type is not None:
            object.__setattr__(self, "pooling_type", check_pooling_type(self.pooling_type))
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise TypeError(f"PoolerConfig.normalize must be a bool or None, got {self.normalize!r}")


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's per-request ``PoolingParams``: ``normalize`` (L2, default the pooler's), ``dimensions``
    (Matryoshka truncation, applied before normalising); ``pooling_type`` is an fxcompiler extension that
    overrides the model's pooling for this request (vLLM fixes it per model)."""

    normalize: bool | None = None
    dimensions: int | None = None
    pooling_type: str | None = None

    def __post_init__(self):
        if self.pooling_type is not None:
            object.__setattr__(self, "pooling_type", check_pooling_type(self.pooling_type))
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise TypeError(f"PoolingParams.normalize must be a bool or None, got {self.normalize!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions must be a positive int or None, got {self.dimensions!r}")


def check_pooling_type(value) -> str:
    if not isinstance(value, str) or value.upper() not in POOLING_TYPES:
        raise ValueError(f"unknown pooling type {value!r}; expected one of {list(POOLING_TYPES)} "
                         "(CLS: the first token's hidden state, MEAN: the mean over the real tokens, "
                         "LAST: the last real token's)")
    return value.upper()


def sentence_transformers_pooling(model_dir) -> PoolerConfig:
    """The pooling a sentence-transformers checkpoint declares (``modules.json`` → ``1_Pooling/config.json``,
    ``Normalize`` module), else an empty config."""
    root = Path(os.fspath(model_dir))
    try:
        modules = json.loads((root / "modules.json").read_text())
    except (OSError, ValueError):
        return PoolerConfig()
    pooling, normalize = None, False
    for m in modules:
        kind = str(m.get("type", ""))
        if kind.endswith("Pooling"):
            try:
                cfg = json.loads((root / m.get("path", "") / "config.json").read_text())
            except (OSError, ValueError):
                continue
            for key, name in (("pooling_mode_cls_token", "CLS"), ("pooling_mode_mean_tokens", "MEAN"),
                              ("pooling_mode_lasttoken", "LAST")):
                if cfg.get(key):
                    pooling = name
                    break
        elif kind.endswith("Normalize"):
            normalize = True
    return PoolerConfig(pooling, normalize)


@dataclass
class EmbeddingOutput:
    """vLLM's ``EmbeddingOutput``: the pooled (optionally normalised) vector."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's ``EmbeddingRequestOutput`` (a ``PoolingRequestOutput``): ``.outputs.embedding``."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None


@dataclass
class ScoringOutput:
    """vLLM's ``ScoringOutput``: one similarity / relevance score."""

    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's ``ScoringRequestOutput``: ``.outputs.score`` of one (text_1, text_2) pair."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationOutput:
    """vLLM's ``ClassificationOutput``: the class probabilities of one input."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """vLLM's ``ClassificationRequestOutput``: ``.outputs.probs`` of one input."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class QuestionAnsweringOutput:
    """What ``bert_forward`` adds to furiosa's ``RequestOutput`` of a question/context pair: the span
    (token positions in ``prompt_token_ids``, inclusive) and the model's start/end logits of every token."""

    start: int
    end: int
    score: float  # start_logits[start] + end_logits[end]
    start_logits: list[float] = field(repr=False, default_factory=list)
    end_logits: list[float] = field(repr=False, default_factory=list)
