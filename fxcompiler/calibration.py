"""Calibration text that ships with every Python: CPython's ``pydoc_data.topics``, split deterministically.

The topics are sorted by name; even-indexed topics form the **calibration** half (what ``fxcompiler
quantize`` may read), odd-indexed topics the **held-out** half (what ``benchmarks/quantization.py``
scores; no calibration ever reads it).
"""
from __future__ import annotations

import hashlib

__all__ = ["calibration_text", "held_out_text", "split_topics", "text_digest"]


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
