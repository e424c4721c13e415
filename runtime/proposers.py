"""Speculative proposers: what guesses the next k tokens of a sequence cheaply.

* :class:`NgramProposer` - prompt lookup (vLLM's ``ngram`` method): the tokens that followed the
  most recent earlier occurrence of the sequence's last n tokens (n from ``max_n`` down to
  ``min_n``). No model, no distribution (a point mass for the rejection sampler).
* :class:`DraftModelProposer` - a smaller (or quantized) model with its own pipelines, block
  manager and paged KV cache, run k steps ahead. It keeps a *shadow* sequence per target
  sequence: the shadow's cache holds the tokens the draft has computed; after verification it
  is rolled back to the accepted prefix (its rejected slots are given back).

A proposer answers ``propose([(seq, k), ...])`` with a :class:`Proposal` per sequence it could
draft for, and hears ``accepted(seq, n_before, n_accepted)`` after verification and
``release(seq)`` when the sequence is finished.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from fxcompiler.pipeline import Bucket
from fxcompiler.sampling_params import SAMPLING_EPS

from .model_runner import ModelRunner
from .sampler import SamplingRow, apply_penalties_and_warpers
from .scheduler import ScheduledBatch
from .sequence import Sequence, SequenceStatus

__all__ = ["Proposal", "NgramProposer", "DraftModelProposer"]


@dataclass(slots=True)
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] the draft distributions (None: point masses)


class NgramProposer:
    """Prompt lookup: propose what followed the last ``n``-gram's most recent earlier occurrence."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def find(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier match of the longest suffix n-gram."""
        L = len(tokens)
        if L <= self.min_n or k <= 0:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            windows = sliding_window_view(arr[:-1], n)  # every n-gram that ends before the last token
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[Sequence, Proposal]:
        out = {}
        for seq, k in wants:
            toks = self.find(seq.all_token_ids(), k)
            if toks:
                out[seq] = Proposal(toks)
        return out

    def accepted(self, seq: Sequence, n_before: int, n_accepted: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def sweep(self) -> None:
        pass


class DraftModelProposer:
    """A draft model with its own runner (pipelines, block manager, KV cache), k steps ahead."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.blocks = runner.blocks
        self.shadows: dict[Sequence, Sequence] = {}
        self.forwards = 0  # draft forwards run (statistics)

    def _shadow(self, seq: Sequence) -> Sequence:
        d = self.shadows.get(seq)
        if d is None:
            d = self.shadows[seq] = Sequence(seq.request_id, seq.index, seq.prompt_token_ids, seq.params, 0,
                                             eos_token_ids=seq.eos_token_ids)
        d.output_token_ids = list(seq.output_token_ids)
        return d

    def _room(self, d: Sequence, num_tokens: int) -> bool:
        if d.slot < 0:
            if not self.blocks._free_slots or self.blocks.blocks_needed(num_tokens) > self.blocks.num_free_blocks:
                return False
            self.blocks.allocate(d, num_tokens)
            return True
        return self.blocks.reserve_lookahead(d, num_tokens)

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[Sequence, Proposal]:
        jobs: list[tuple[Sequence, Sequence, int]] = []
        for seq, k in wants:
            d = self._shadow(seq)
            need = seq.num_tokens + k - 1  # the draft computes up to d_{k-1}
            if not self._room(d, need):
                self._evict_waiting()
                if not self._room(d, need):
                    continue
            jobs.append((seq, d, k))
        if not jobs:
            return {}
        drafted: dict[Sequence, list[int]] = {d: [] for _, d, _ in jobs}
        probs: dict[Sequence, list[torch.Tensor]] = {d: [] for _, d, _ in jobs}
        # step 1: catch up on the tokens the draft has not computed (the prompt, accepted tokens)
        shadows = [d for _, d, _ in jobs]
        num_new = [d.num_tokens - d.num_cached for d in shadows]
        batch = ScheduledBatch(Bucket.prefill(len(shadows), max(num_new)), shadows, prefill=True, num_new=num_new)
        logits = self.runner.execute(batch)
        self.forwards += 1
        last = torch.tensor([f + c - 1 for f, c in batch.logit_rows], device=logits.device)
        self._draw(logits[last], shadows, drafted, probs)
        k_of = {d: k for _, d, k in jobs}
        while True:
            active = [d for d in shadows if len(drafted[d]) < k_of[d]]
            if not active:
                break
            batch = ScheduledBatch(Bucket.decode(len(active), max(d.num_tokens for d in active)), active,
                                   prefill=False, num_new=[1] * len(active))
            logits = self.runner.execute(batch)
            self.forwards += 1
            self._draw(logits, active, drafted, probs)
        out = {}
        for seq, d, _ in jobs:
            del d.output_token_ids[len(seq.output_token_ids):]  # the drafts are not the sequence's (yet)
            p = torch.stack(probs[d]) if probs[d] and probs[d][0] is not None else None
            out[seq] = Proposal(drafted[d], p)
        return out

    @staticmethod
    def _draw(logits: torch.Tensor, shadows: list[Sequence], drafted, probs) -> None:
        """The draft's next token per shadow: its argmax for greedy requests, else a draw from its
        distribution after the request's own penalties and filters (kept for the rejection sampler)."""
        greedy = [d.params.temperature < SAMPLING_EPS for d in shadows]
        plain = all(greedy) and all(d.params.repetition_penalty == 1.0 and not d.params.presence_penalty
                                    and not d.params.frequency_penalty and not d.params.logit_bias
                                    and not d.params.min_tokens for d in shadows)
        if plain:
            toks = logits.argmax(dim=-1).tolist()
            x = None
        else:
            rows = [SamplingRow(d.params, d.prompt_token_ids, d.output_token_ids, d.eos_token_ids) for d in shadows]
            x = apply_penalties_and_warpers(logits, rows).softmax(dim=-1)
            toks = x.argmax(dim=-1)
            if not all(greedy):
                drawn = torch.multinomial(x, 1).squeeze(1)
                toks = torch.where(torch.tensor(greedy), toks, drawn)
            toks = toks.tolist()
        for i, (d, t) in enumerate(zip(shadows, toks)):
            drafted[d].append(t)
            probs[d].append(None if greedy[i] or x is None else x[i])
            d.output_token_ids.append(t)

    def accepted(self, seq: Sequence, n_before: int, n_accepted: int) -> None:
        """Verification kept ``n_accepted`` drafts after ``n_before`` tokens: the draft's cache stays
        valid for ``[0, n_before + n_accepted)``; later slots are given back."""
        d = self.shadows.get(seq)
        if d is None or d.slot < 0:
            return
        d.num_cached = min(d.num_cached, n_before + n_accepted)
        self.blocks.trim(d, d.num_cached)

    def release(self, seq: Sequence) -> None:
        d = self.shadows.pop(seq, None)
        if d is not None:
            self.blocks.free(d)

    def _evict_waiting(self) -> None:
        """Give back the draft cache of target sequences that were preempted (recomputed later)."""
        for seq, d in list(self.shadows.items()):
            if seq.status is SequenceStatus.WAITING and d.slot >= 0:
                self.blocks.free(d)

    def sweep(self) -> None:
        """Release the shadows of finished target sequences."""
        for seq in [s for s in self.shadows if s.is_finished]:
            self.release(seq)
