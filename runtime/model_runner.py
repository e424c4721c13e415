"""Builds one step's input tensors for a scheduled batch and runs the bucket's executable.

Inputs are assembled with NumPy over whole arrays (block tables come from the block
manager's matrix with one gather); Python touches each sequence once per step, never
each token or graph op. The graphs are shape-dynamic (one graph serves every bucket), so
a step computes only its real rows: ``len(seqs)`` sequences, and in prefill the longest
``num_new`` of the batch, not the bucket's batch and attention sizes (the bucket decides
which sequences share a step; padding a 1-token prompt to a 16-token bucket cost 34 against
26.5 ms fp32). Decode attends over the real context only: the block table is cut to the
longest sequence in the batch.
"""
from __future__ import annotations

import numpy as np
import torch

from fxcompiler.pipeline import Bucket

from .block_manager import BlockManager, PagedKVCache
from .scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, executables: dict[Bucket, object], kv_cache: PagedKVCache, blocks: BlockManager,
                 device: torch.device):
        self.executables = executables
        self.kv = kv_cache
        self.blocks = blocks
        self.device = device
        self.block_size = blocks.block_size

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one step; returns the logits rows named by ``batch.logit_rows`` (set here): each
        sequence's last computed token, plus every computed prompt position of a sequence that
        asked for prompt logprobs. Pending copy-on-write block copies are done first."""
        self.kv.copy_blocks(self.blocks.take_pending_copies())
        inputs = self.prepare_prefill(batch) if batch.is_prefill else self.prepare_decode(batch)
        return self.run(batch.bucket, inputs)

    def run(self, bucket: Bucket, inputs: tuple) -> torch.Tensor:
        """Run ``bucket``'s executable on step inputs built by :meth:`_tensors` (also the speculative
        verify step's, whose sequences compute k + 1 tokens each through the decode bucket)."""
        with torch.inference_mode():
            return self.executables[bucket](*inputs)

    def _tensors(self, ids, pos, table, slots, seq_lens, logits_idx):
        dev = self.device
        t = [torch.from_numpy(a).to(dev) for a in (ids, pos)]
        rest = [torch.from_numpy(a).to(dev) for a in (table, slots, seq_lens, logits_idx)]
        return (*t, *self.kv.k, *self.kv.v, *rest)

    def prepare_prefill(self, batch: ScheduledBatch):
        """Each sequence computes ``num_new`` tokens from ``num_cached`` on (its whole prompt, the
        part the prefix cache lacks, or a chunk), attending over the cached context before them."""
        seqs, bs = batch.seqs, self.block_size
        B, T = len(seqs), max(batch.num_new)  # the real rows and tokens (the graphs are shape-dynamic)
        ids = np.zeros((B, T), dtype=np.int64)
        pos = np.zeros((B, T), dtype=np.int64)
        slots = np.zeros((B, T), dtype=np.int64)  # padding writes go to the null block
        seq_lens = np.ones(B, dtype=np.int64)
        ends = [s.num_cached + q for s, q in zip(seqs, batch.num_new)]
        rows = np.array([s.slot for s in seqs], dtype=np.int64)
        width = -(-max(ends) // bs)
        table = np.zeros((B, width), dtype=np.int64)
        table[: len(seqs)] = self.blocks.block_tables[rows, :width]
        logits_idx: list[int] = []
        layout: list[tuple[int, int]] = []
        for i, (s, q, end) in enumerate(zip(seqs, batch.num_new, ends)):
            start = s.num_cached
            toks = s.all_token_ids()[start:end]
            p = np.arange(start, end, dtype=np.int64)
            ids[i, :q] = toks
            pos[i, :q] = p
            slots[i, :q] = table[i, p // bs] * bs + p % bs
            seq_lens[i] = end
            first = len(logits_idx)
            if s.params.prompt_logprobs is not None and start < len(s.prompt_token_ids) - 1:
                logits_idx.extend(range(i * T, i * T + q))
            else:
                logits_idx.append(i * T + q - 1)
            layout.append((first, len(logits_idx) - first))
            s.num_cached = end
        batch.logit_rows = layout
        return self._tensors(ids, pos, table, slots, seq_lens, np.array(logits_idx, dtype=np.int64))

    def prepare_decode(self, batch: ScheduledBatch):
        """One token per sequence: its last one, at position ``num_tokens - 1``. Per-sequence values are
        gathered in one Python pass and become arrays once (a decode step of few sequences is dominated
        by fixed costs per array operation, not by its rows)."""
        seqs, bs = batch.seqs, self.block_size
        n = len(seqs)
        rows, lens, last = [0] * n, [0] * n, [0] * n
        for i, s in enumerate(seqs):
            k = s.num_tokens
            rows[i], lens[i] = s.slot, k
            last[i] = s.output_token_ids[-1] if s.output_token_ids else s.prompt_token_ids[-1]
            s.num_cached = k
        width = -(-max(lens) // bs)
        table = self.blocks.block_tables[rows, :width]  # a copy (fancy index): later block growth cannot alias it
        seq_lens = np.array(lens, dtype=np.int64)
        pos = (seq_lens - 1).reshape(n, 1)
        slots = table[np.arange(n)[:, None], pos // bs] * bs + pos % bs
        ids = np.array(last, dtype=np.int64).reshape(n, 1)
        batch.logit_rows = [(i, 1) for i in range(n)]
        return self._tensors(ids, pos, table, slots, seq_lens, np.arange(n, dtype=np.int64))
