"""Tiny configs of transformers' own encoder-task classes and the parity checks each one is tested with.

``tests/test_encoder_tasks.py`` runs exactly the checks listed here (it is parametrised over
:data:`ENCODER_ZOO`), and the support table (``fxcompiler models``) renders its parity column from the same
list, so the table names no check that no test runs. Sizes are tiny (hidden 32, 2 layers): every case is
exported once per test module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .encoder_tasks import EMBED, QA, SCORE

__all__ = ["ENCODER_ZOO", "EncoderCase", "CHECKS", "encoder_config", "encoder_names", "VOCAB_SIZE", "MAX_POSITIONS"]

VOCAB_SIZE = 128
MAX_POSITIONS = 64  # tokens a BERT case holds (RoBERTa-style cases get pad_token_id + 1 more positions)

# check id -> what the test asserts (fp64, through the whole default pass pipeline and fx supertasks,
# prompts of different lengths batched in padded buckets, against transformers on each unpadded prompt)
CHECKS = {
    "qa_logits": "start/end logits",
    "qa_span": "answer spans",
    "pool_cls": "CLS pooling",
    "pool_mean": "MEAN pooling",
    "pool_last": "LAST pooling",
    "normalize": "L2 normalisation",
    "st_pooling": "sentence-transformers pooling config",
    "score_cosine": "cosine scores",
    "score_cross": "cross-encoder scores",
}
TOLERANCE = 1e-5


@dataclass(frozen=True)
class EncoderCase:
    name: str
    model_class: str  # the transformers class a checkpoint's ``architectures`` names
    task: str  # encoder_tasks.QA / EMBED / SCORE
    constructs: str
    checks: tuple[str, ...]
    build: Callable[[], object]  # -> transformers config


def _t():
    import transformers

    return transformers


_SIZES = dict(vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=64)


def _bert(**extra):
    return lambda: _t().BertConfig(**_SIZES, max_position_embeddings=MAX_POSITIONS, pad_token_id=0, **extra)


def _xlmr(**extra):
    return lambda: _t().XLMRobertaConfig(**_SIZES, max_position_embeddings=MAX_POSITIONS + 2, pad_token_id=1,
                                         bos_token_id=0, eos_token_id=2, type_vocab_size=1, **extra)


def _qwen2():
    return _t().Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=MAX_POSITIONS,
                            pad_token_id=0, bos_token_id=1, eos_token_id=2,
                            architectures=["Qwen2ForCausalLM"])


_CASES = [
    EncoderCase("bert_qa", "BertForQuestionAnswering", QA, "post-LN, GELU, token types, learned positions",
                ("qa_logits", "qa_span"), _bert(architectures=["BertForQuestionAnswering"])),
    EncoderCase("bert_embed", "BertModel", EMBED, "bidirectional attention, padding mask, sentence-transformers "
                "MEAN + Normalize modules", ("st_pooling", "pool_cls", "pool_mean", "pool_last", "normalize",
                                             "score_cosine"),
                _bert(architectures=["BertModel"])),
    EncoderCase("bert_cross_encoder", "BertForSequenceClassification", SCORE, "pooler (dense + tanh), 1 label",
                ("score_cross",), _bert(architectures=["BertForSequenceClassification"], num_labels=1)),
    EncoderCase("xlm_roberta_cross_encoder", "XLMRobertaForSequenceClassification", SCORE,
                "positions from padding_idx, classification head on <s>", ("score_cross",),
                _xlmr(architectures=["XLMRobertaForSequenceClassification"], num_labels=1)),
    EncoderCase("qwen2_embed", "Qwen2ForCausalLM (base model)", EMBED, "causal + padding mask, GQA, RoPE",
                ("pool_last", "pool_mean"), _qwen2),
]

ENCODER_ZOO: dict[str, EncoderCase] = {c.name: c for c in _CASES}


def encoder_names() -> list[str]:
    return [c.name for c in _CASES]


def encoder_config(name: str):
    if name not in ENCODER_ZOO:
        raise ValueError(f"unknown encoder case {name!r}; expected one of {encoder_names()}")
    return ENCODER_ZOO[name].build()


def parity_text(case: EncoderCase) -> str:
    """The support table's parity column of ``case``: what its tests assert."""
    return f"fp64 fx (max abs <= {TOLERANCE:g}): " + ", ".join(CHECKS[c] for c in case.checks)
