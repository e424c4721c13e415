"""Builds one step's input tensors for a scheduled batch and runs the bucket's executable.

Inputs are assembled with NumPy over whole arrays (block tables come from the block
manager's matrix with one gather); Python touches each sequence once per step, never
each token or graph op. Batches are padded to the bucket's batch size (and prefill
prompts to its attention size); decode attends over the real context only: the
block table is cut to the longest sequence in the batch.
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
        """Run one step; returns logits ``[len(batch.seqs), vocab]`` (rows beyond are never computed)."""
        inputs = self.prepare_prefill(batch) if batch.is_prefill else self.prepare_decode(batch)
        exe = self.executables[batch.bucket]
        with torch.inference_mode():
            return exe(*inputs)

    def _tensors(self, ids, pos, table, slots, seq_lens, logits_idx):
        dev = self.device
        t = [torch.from_numpy(a).to(dev) for a in (ids, pos)]
        rest = [torch.from_numpy(a).to(dev) for a in (table, slots, seq_lens, logits_idx)]
        return (*t, *self.kv.k, *self.kv.v, *rest)

    def prepare_prefill(self, batch: ScheduledBatch):
        seqs, bucket, bs = batch.seqs, batch.bucket, self.block_size
        B, T = bucket.batch_size, bucket.attention_size
        ids = np.zeros((B, T), dtype=np.int64)
        pos = np.zeros((B, T), dtype=np.int64)
        slots = np.zeros((B, T), dtype=np.int64)  # padding writes go to the null block
        seq_lens = np.ones(B, dtype=np.int64)
        logits_idx = np.empty(len(seqs), dtype=np.int64)
        rows = np.array([s.slot for s in seqs], dtype=np.int64)
        max_blocks = int(self.blocks.num_seq_blocks[rows].max())
        table = np.zeros((B, max_blocks), dtype=np.int64)
        table[: len(seqs)] = self.blocks.block_tables[rows, :max_blocks]
        ar = np.arange(T, dtype=np.int64)
        for i, s in enumerate(seqs):
            toks = s.all_token_ids()
            n = len(toks)
            ids[i, :n] = toks
            pos[i, :n] = ar[:n]
            slots[i, :n] = table[i, ar[:n] // bs] * bs + ar[:n] % bs
            seq_lens[i] = n
            logits_idx[i] = i * T + n - 1
            s.num_cached = n
        return self._tensors(ids, pos, table, slots, seq_lens, logits_idx)

    def prepare_decode(self, batch: ScheduledBatch):
        seqs, bucket, bs = batch.seqs, batch.bucket, self.block_size
        B, n = bucket.batch_size, len(seqs)
        rows = np.array([s.slot for s in seqs], dtype=np.int64)
        lens = np.array([s.num_tokens for s in seqs], dtype=np.int64)
        last = np.array([s.last_token for s in seqs], dtype=np.int64)
        width = int(-(-lens.max() // bs))
        table = np.zeros((B, width), dtype=np.int64)
        table[:n] = self.blocks.block_tables[rows, :width]
        ids = np.zeros((B, 1), dtype=np.int64)
        pos = np.zeros((B, 1), dtype=np.int64)
        slots = np.zeros((B, 1), dtype=np.int64)
        seq_lens = np.ones(B, dtype=np.int64)
        p = lens - 1
        ids[:n, 0] = last
        pos[:n, 0] = p
        slots[:n, 0] = table[np.arange(n), p // bs] * bs + p % bs
        seq_lens[:n] = lens
        for s in seqs:
            s.num_cached = s.num_tokens
        return self._tensors(ids, pos, table, slots, seq_lens, np.arange(n, dtype=np.int64))
