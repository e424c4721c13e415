"""Incremental (streaming) detokenisation, UTF-8 safe.

Follows vLLM's ``detokenize_incrementally`` prefix/read-offset scheme: each
step decodes a short window ``ids[prefix:]`` and emits only the text beyond
the decoded ``ids[prefix:read]``. Text whose decoding ends in U+FFFD (an
incomplete multi-byte character) is held back until a later token completes
it, or until ``flush()``. Decoding a window (instead of single tokens) keeps
tokenizer-specific joins (e.g. SentencePiece leading spaces) right.

For byte-level BPE tokenizers the concatenated deltas equal
``tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
# prompt tokens kept as left context for the first window (vLLM uses 5)
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        ctx = list(prompt_token_ids[-_PROMPT_CONTEXT:]) if _PROMPT_CONTEXT else []
        # The prompt tail is only usable as context if it ends on a character
        # boundary; otherwise its partial bytes would glue onto our output.
        if ctx and self._decode(ctx).endswith(_REPLACEMENT):
            ctx = []
        self._ids: list[int] = ctx
        self._prefix = 0  # start of the decode window
        self._read = len(ctx)  # ids before this have been emitted
        self._prefix_text: str | None = None  # cached decode of ids[prefix:read]
        self._parts: list[str] = []

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(
            list(ids), skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def _step(self, final: bool) -> str:
        if len(self._ids) == self._read:
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        prefix_text = self._prefix_text
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(_REPLACEMENT)):
            return ""  # nothing new yet, or an incomplete character: hold back
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = None
        self._parts.append(delta)
        return delta

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text that became final."""
        self._ids.extend(token_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (call once the request has finished)."""
        return self._step(final=True)

    @property
    def text(self) -> str:
        """Output text emitted so far (excludes held-back tokens until flush)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def has_pending(self) -> bool:
        """True when some pushed tokens have not been emitted as text yet."""
        return len(self._ids) > self._read
