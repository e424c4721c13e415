"""Continuous-batching scheduler: each step is a prefill batch of waiting prompts or a decode
batch of running sequences, fitted to the smallest bucket that holds it.

Prefill is preferred (new requests join as soon as blocks allow); when the cache cannot
give every running sequence its next slot, the newest sequences are preempted and later
recomputed from their prompt plus the tokens they already produced.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from fxcompiler.config import SchedulerConfig
from fxcompiler.pipeline import Bucket

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus

log = logging.getLogger("fxcompiler.scheduler")

PREFILL_SMALL_STEP_TOKENS = 256
PREFILL_LOOKAHEAD = 64


@dataclass(slots=True)
class ScheduledBatch:
    bucket: Bucket
    seqs: list[Sequence]

    @property
    def is_prefill(self) -> bool:
        return self.bucket.is_prefill


def smallest_bucket(buckets: list[Bucket], batch: int, attention: int) -> Bucket | None:
    best = None
    for b in buckets:
        if b.batch_size >= batch and b.attention_size >= attention:
            if best is None or (b.batch_size * b.attention_size, b.batch_size) < (
                    best.batch_size * best.attention_size, best.batch_size):
                best = b
    return best


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, prefill_buckets: list[Bucket],
                 decode_buckets: list[Bucket]):
        if not prefill_buckets or not decode_buckets:
            raise ValueError("the scheduler needs at least one prefill and one decode bucket")
        self.config = config
        self.blocks = blocks
        self.prefill_buckets = sorted(prefill_buckets)
        self.decode_buckets = sorted(decode_buckets)
        self.max_prefill_batch = max(b.batch_size for b in prefill_buckets)
        self.max_decode_batch = max(b.batch_size for b in decode_buckets)
        self.max_prompt_len = max(b.attention_size for b in prefill_buckets)
        self.max_context = max(b.attention_size for b in decode_buckets)
        self.spare_blocks = int(config.spare_blocks_ratio * blocks.num_usable_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> list[Sequence]:
        gone = [s for s in list(self.waiting) + self.running if s.request_id == request_id]
        for s in gone:
            self.finish(s, "abort")
        return gone

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.blocks.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
        return batch

    def _schedule_prefill(self) -> ScheduledBatch | None:
        room = min(self.max_prefill_batch, self.config.max_processing_samples - len(self.running),
                   self.max_decode_batch - len(self.running))
        chosen: list[Sequence] = []
        longest, real_tokens, used_blocks = 0, 0, 0
        bucket = None
        for looked, seq in enumerate(self.waiting):
            # FIFO for the head of the queue; later prompts may join it when they fit its
            # shape (grouping similar lengths), looking a bounded way ahead.
            if len(chosen) >= room or looked >= PREFILL_LOOKAHEAD:
                break
            n = seq.num_tokens
            # Reserve the spare blocks for running sequences, and one block per running
            # sequence so admitting prompts does not immediately force preemption.
            # (With nothing running there is nothing to reserve for.)
            reserve = 0 if not self.running and not chosen else \
                self.spare_blocks + (len(self.running) if not self.config.is_offline else 0)
            need = self.blocks.blocks_needed(n + 1)
            if not self.blocks._free_slots or used_blocks + need + reserve > self.blocks.num_free_blocks \
                    or len(self.running) + len(chosen) >= self.blocks.block_tables.shape[0]:
                break
            cand = smallest_bucket(self.prefill_buckets, len(chosen) + 1, max(longest, n))
            if cand is None:
                if not chosen and seq.output_token_ids:
                    # A preempted sequence longer than any prompt bucket is recomputed alone
                    # (fx graphs are shape-dynamic; the bucket only fixes the padding).
                    chosen, bucket = [seq], Bucket.prefill(1, n)
                    break
                continue
            # Padded tokens cost as much compute as real ones: batch prompts while the padding
            # stays under 25%, or while the whole step is small enough to be overhead-bound.
            area = cand.batch_size * cand.attention_size
            if chosen and area > PREFILL_SMALL_STEP_TOKENS and area > 1.25 * (real_tokens + n) \
                    and area > bucket.batch_size * bucket.attention_size:
                continue
            chosen.append(seq)
            bucket = cand
            longest, real_tokens, used_blocks = max(longest, n), real_tokens + n, used_blocks + need
        if not chosen:
            return None
        for seq in chosen:
            self.waiting.remove(seq)
            self.blocks.allocate(seq, seq.num_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return ScheduledBatch(bucket, chosen)

    def _schedule_decode(self) -> ScheduledBatch | None:
        if not self.running:
            if self.waiting:
                head = self.waiting[0]
                raise RuntimeError(
                    f"request {head.request_id} ({head.num_tokens} tokens) cannot be scheduled: the KV cache has "
                    f"{self.blocks.num_usable_blocks} usable blocks of {self.blocks.block_size} tokens; raise "
                    "paged_attention_num_blocks or kv_cache_memory_bytes")
            return None
        seqs = self.running[: self.max_decode_batch]
        while not self.blocks.can_append(seqs):
            victim = self.running[-1]
            if victim is seqs[0] and len(self.running) == 1:
                raise RuntimeError("the KV cache is too small for a single sequence's context")
            self._preempt(victim)
            seqs = self.running[: self.max_decode_batch]
        self.blocks.may_append(seqs)
        longest = max(s.num_tokens for s in seqs)
        bucket = smallest_bucket(self.decode_buckets, len(seqs), longest)
        if bucket is None:  # cannot happen: lengths are validated against max_context on admission
            raise RuntimeError(f"no decode bucket for batch {len(seqs)} and context {longest}")
        return ScheduledBatch(bucket, seqs)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        log.info("preempted %s (recompute %d tokens later)", seq.request_id, seq.num_tokens)
