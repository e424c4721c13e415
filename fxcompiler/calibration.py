"""Calibration text that ships with every Python: CPython's ``pydoc_data.topics``, split deterministically.

The topics are sorted by name; even-indexed topics form the **calibration** half (what ``fxcompiler
quantize`` may read), odd-indexed topics the **held-out** half (what ``benchmarks/quantization.py``
scores; no calibration ever reads it).
"""
from __future__ import annotations

import hashlib

__all__ = ["calibration_samples", "calibration_text", "held_out_text", "split_topics", "text_digest"]


def split_topics() -> tuple[str, str]:
    """``(calibration half, held-out half)`` of ``pydoc_data.topics``."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    return "\n\n".join(topics[n] for n in names[0::2]), "\n\n".join(topics[n] for n in names[1::2])


def calibration_text() -> str:
    return split_topics()[0]


def held_out_text() -> str:
    return split_topics()[1]


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def calibration_samples(text: str, tokenizer, vocab_size: int, num_samples: int, seq_len: int, seed: int
                        ) -> tuple[list, str]:
    """``num_samples`` windows of ``seq_len`` token ids (``[1, seq_len]`` int64 tensors) from ``text`` at
    offsets drawn with ``seed``, and how the text was tokenized. Without a tokenizer the text's UTF-8
    bytes are the ids (modulo ``vocab_size``)."""
    import torch

    if tokenizer is not None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        how = f"tokenizer {type(tokenizer).__name__}"
    else:
        ids = [b % vocab_size for b in text.encode("utf-8")]
        how = f"UTF-8 bytes modulo vocab_size={vocab_size} (the model has no tokenizer)"
    if len(ids) <= seq_len:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than --seq-len {seq_len} + 1")
    ids = torch.tensor(ids, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seq_len, (num_samples,), generator=gen)
    return [ids[int(s):int(s) + seq_len][None, :].clone() for s in starts], how
