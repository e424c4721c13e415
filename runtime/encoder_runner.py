"""Run an encoder task's compiled pipelines over a list of token rows: length checks, batching by
padding to buckets, the padding mask (``seq_lens``), pooling weights, and the unpadded results.

Rows are grouped shortest first; each group is padded to the smallest bucket that holds its batch and its
longest row (``input_ids`` with the model's pad id, ``token_type_ids`` with 0); padded rows get length 1
and their results are dropped. Results come back in the order of the rows given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

POOLING_TYPES = ("CLS", "MEAN", "LAST")


@dataclass
class EncoderRow:
    """One request: token ids, optional token types (segment ids) and, for embeddings, its pooling."""

    input_ids: list[int]
    token_type_ids: list[int] | None = None
    pooling_type: str | None = None


class EncoderRunner:
    """``run(rows) -> list[Tensor]``: per row the task's output (QA: ``[len, 2]`` start/end logits; scoring:
    ``[num_labels]``; embedding: ``[hidden]`` pooled, not normalised)."""

    def __init__(self, executable: Callable[..., torch.Tensor], geometry: Any, buckets: Sequence, device: torch.device,
                 input_order: Sequence[str] | None = None):
        self.executable = executable
        self.g = geometry
        self.device = device
        self.input_order = tuple(input_order or geometry.inputs)  # the executable's user inputs, by target name
        self.buckets = sorted(buckets, key=lambda b: (b.attention_size * b.batch_size, b.attention_size))
        if not self.buckets:
            raise ValueError("an encoder LLM needs at least one (batch, attention) bucket")
        self.max_len = max(b.attention_size for b in self.buckets)
        self.steps = 0  # executable calls (one per padded batch)

    # -- checks ---------------------------------------------------------------------------------------
    def check(self, rows: Sequence[EncoderRow]) -> None:
        for i, row in enumerate(rows):
            n = len(row.input_ids)
            if n == 0:
                raise ValueError(f"request {i} is empty after tokenization")
            if n > self.g.max_tokens:
                raise ValueError(
                    f"request {i} has {n} tokens, more than the model's max_position_embeddings allows "
                    f"({self.g.max_tokens} tokens; max_position_embeddings={self.g.max_position_embeddings})")
            if n > self.max_len:
                raise ValueError(f"request {i} has {n} tokens, more than the largest bucket's attention size "
                                 f"{self.max_len} (raise max_seq_len_to_capture / the buckets, at most "
                                 f"{self.g.max_tokens})")
            if row.token_type_ids is not None and len(row.token_type_ids) != n:
                raise ValueError(f"request {i}: {len(row.token_type_ids)} token_type_ids for {n} tokens")
            if row.pooling_type is not None and row.pooling_type not in POOLING_TYPES:
                raise ValueError(f"unknown pooling type {row.pooling_type!r}; expected one of {list(POOLING_TYPES)}")
            bad = [t for t in row.input_ids if not isinstance(t, int) or not 0 <= t < self.g.vocab_size]
            if bad:
                raise ValueError(f"request {i}: token id {bad[0]!r} is outside the vocabulary [0, {self.g.vocab_size})")

    def _bucket(self, n: int, longest: int):
        for b in self.buckets:  # smallest padded area first
            if b.batch_size >= n and b.attention_size >= longest:
                return b
        return None

    def _groups(self, rows: Sequence[EncoderRow]) -> list[tuple[list[int], Any]]:
        """Row indices per padded batch (shortest rows first) and the bucket each batch runs in."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].input_ids))
        groups, start = [], 0
        while start < len(order):
            end = start + 1
            while end < len(order) and self._bucket(end + 1 - start, len(rows[order[end]].input_ids)) is not None:
                end += 1
            idx = order[start:end]
            groups.append((idx, self._bucket(len(idx), len(rows[idx[-1]].input_ids))))
            start = end
        return groups

    # -- running --------------------------------------------------------------------------------------
    def inputs(self, rows: Sequence[EncoderRow], bucket) -> list[torch.Tensor]:
        """The padded user inputs of one batch, in the graph's order."""
        b, t = bucket.batch_size, bucket.attention_size
        ids = torch.full((b, t), self.g.pad_token_id, dtype=torch.long)
        types = torch.zeros((b, t), dtype=torch.long)
        lens = torch.ones(b, dtype=torch.long)
        weights = torch.zeros((b, t), dtype=self.g.dtype)
        for r, row in enumerate(rows):
            n = len(row.input_ids)
            ids[r, :n] = torch.tensor(row.input_ids, dtype=torch.long)
            if row.token_type_ids is not None:
                types[r, :n] = torch.tensor(row.token_type_ids, dtype=torch.long)
            lens[r] = n
            pooling = row.pooling_type or "CLS"
            if pooling == "CLS":
                weights[r, 0] = 1.0
            elif pooling == "LAST":
                weights[r, n - 1] = 1.0
            else:
                weights[r, :n] = 1.0 / n
        by_name = {"input_ids": ids, "token_type_ids": types, "seq_lens": lens, "pooling_weights": weights}
        return [by_name[name].to(self.device) for name in self.input_order]

    def run(self, rows: Sequence[EncoderRow]) -> list[torch.Tensor]:
        self.check(rows)
        results: list[torch.Tensor | None] = [None] * len(rows)
        for idx, bucket in self._groups(rows):
            batch = [rows[i] for i in idx]
            with torch.no_grad():
                out = self.executable(*self.inputs(batch, bucket))
            self.steps += 1
            out = out.detach().to("cpu")
            for r, i in enumerate(idx):
                results[i] = out[r, :len(rows[i].input_ids)] if self.g.task == "question-answering" else out[r]
        return results

    def warm_up(self) -> None:
        """One run on two short rows; raises when the compiled graph gives non-finite results."""
        n = min(4, self.max_len)
        rows = [EncoderRow([min(5, self.g.vocab_size - 1)] * n), EncoderRow([min(6, self.g.vocab_size - 1)] * max(1, n - 1))]
        for out in self.run(rows):
            if out.is_floating_point() and not bool(torch.isfinite(out).all()):
                raise RuntimeError("the compiled encoder graph gives non-finite outputs on example inputs; "
                                   "`FXCOMPILER_VERIFY_PASSES=each` names the pass")
