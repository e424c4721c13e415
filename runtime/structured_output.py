"""Structured output: a token bitmask per constrained sequence, from llguidance matchers.

Requires: the engine's HF fast tokenizer and the logits' vocabulary width.
Ensures: a sequence whose ``params.guided_decoding`` is set gets a :class:`GrammarState`; before
each sample its logits row keeps only the tokens the grammar allows next (others -inf), after it
the sampled token advances the matcher. Rows without a constraint are not touched (the sampler's
plain greedy fast path stays on for them, and for the whole batch when no row is constrained).
Compiled grammars are cached per constraint (an LRU of ``GrammarCompiler.CACHE_SIZE`` entries).
"""
from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Any, Sequence

import torch

from fxcompiler.guided_decoding import GuidedDecodingParams
from fxcompiler.ops.sampling import apply_token_bitmask

log = logging.getLogger("fxcompiler.structured_output")

__all__ = ["GrammarCompiler", "GrammarState", "mask_logits"]


# JSON is written on one line, `{"a": 1, "b": [2, 3]}` (flexible whitespace lets a model pad forever);
# a schema's "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(g: GuidedDecodingParams) -> str:
    """The llguidance grammar (its JSON/Lark text) of one constraint."""
    from llguidance import LLMatcher

    kind = g.kind
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(g.json, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(g.regex)
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in g.choice))
    return LLMatcher.grammar_from_lark(g.grammar)


class GrammarCompiler:
    """Validates and caches grammars for one tokenizer; hands out a fresh matcher per sequence."""

    CACHE_SIZE = 256

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]):
        import llguidance.hf

        if tokenizer is None:
            raise ValueError("guided_decoding needs the model's tokenizer; this engine has none")
        self.vocab_size = int(vocab_size)
        eos = sorted(int(t) for t in eos_token_ids) or None
        hf = getattr(tokenizer, "hf_tokenizer", tokenizer)  # llguidance needs transformers' own (not a LightTokenizer)
        self.tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
        self.eos_token_ids = list(eos or ())
        self._cache: OrderedDict[str, str] = OrderedDict()

    def grammar(self, g: GuidedDecodingParams) -> str:
        """The validated grammar text of ``g`` (cached); ValueError naming what is wrong."""
        from llguidance import LLMatcher

        key = g.cache_key()
        text = self._cache.get(key)
        if text is not None:
            self._cache.move_to_end(key)
            return text
        try:
            text = grammar_text(g)
        except ValueError as exc:
            raise ValueError(f"invalid guided_decoding {g.kind}: {exc}") from None
        error = LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise ValueError(f"invalid guided_decoding {g.kind}: {error.strip()}")
        self._cache[key] = text
        while len(self._cache) > self.CACHE_SIZE:
            self._cache.popitem(last=False)
        return text

    def new_state(self, g: GuidedDecodingParams) -> "GrammarState":
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, self.grammar(g), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid guided_decoding {g.kind}: {matcher.get_error()}")
        return GrammarState(matcher, self)


class GrammarState:
    """One sequence's position in its grammar."""

    __slots__ = ("matcher", "compiler")

    def __init__(self, matcher: Any, compiler: GrammarCompiler):
        self.matcher = matcher
        self.compiler = compiler

    def fill_mask(self, row: torch.Tensor) -> None:
        """Write the allowed-next-token bitmask into ``row`` (int32, ceil(V/32) words)."""
        m = self.matcher
        if m.is_error():
            log.warning("structured output matcher in error state: %s (only EOS allowed)", m.get_error())
            row.zero_()
        else:
            m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if not bool(row.any()):  # nothing allowed (error, or stopped without EOS): end the sequence
            for t in self.compiler.eos_token_ids:
                row[t // 32] |= (1 << (t % 32)) if t % 32 != 31 else -(1 << 31)

    def accept(self, token: int) -> None:
        if not self.matcher.is_stopped():
            self.matcher.consume_token(int(token))

    @property
    def is_stopped(self) -> bool:
        return bool(self.matcher.is_stopped())


def fill_masks(states: Sequence[GrammarState], bitmask: torch.Tensor) -> None:
    """Rows of ``bitmask`` (int32 [len(states), ceil(V/32)]) filled with each state's allowed tokens, one row
    after the other (llguidance's thread-pool executor was no faster here: its workers spin on the cores the
    next forward needs)."""
    for j, s in enumerate(states):
        s.fill_mask(bitmask[j])


def mask_logits(logits: torch.Tensor, seqs: Sequence[Any]) -> torch.Tensor:
    """``logits`` [B, V] with the rows of constrained sequences masked (a copy; others unchanged), through
    ``fxc::apply_token_bitmask`` (on CPU one C++ pass per row)."""
    idx = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not idx:
        return logits
    words = (logits.shape[1] + 31) // 32
    bitmask = torch.zeros(len(idx), words, dtype=torch.int32)
    fill_masks([seqs[i].grammar for i in idx], bitmask)
    return apply_token_bitmask(logits, bitmask.to(logits.device), torch.tensor(idx, device=logits.device))
