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
# While a long prompt is prefilled in chunks, running sequences decode at least this long
# (relative to the last chunk step's time) between two chunks: chunks take at most about
# 40% of the wall time, so decode latency stays well within 2x of its undisturbed value.
CHUNK_DECODE_RATIO = 1.5


@dataclass(slots=True)
class ScheduledBatch:
    """One step: ``seqs`` each compute their tokens ``[num_cached, num_cached + num_new[i])``.

    A prefill batch computes prompt tokens (all of them, or what the prefix cache does not
    hold, or one chunk of a long prompt); a decode batch computes one token per sequence.
    Sequences whose last token is computed in this step sample their next token."""

    bucket: Bucket
    seqs: list[Sequence]
    prefill: bool | None = None  # None: the bucket's phase
    num_new: list[int] | None = None  # None: every uncomputed token of each sequence
    logit_rows: list[tuple[int, int]] | None = None  # (first row, rows) of each sequence in the logits

    def __post_init__(self):
        if self.num_new is None:
            self.num_new = [s.num_tokens - s.num_cached for s in self.seqs]

    @property
    def is_prefill(self) -> bool:
        return self.bucket.is_prefill if self.prefill is None else self.prefill

    @property
    def is_chunk(self) -> bool:
        """A prefill piece that does not reach the end of its sequence's tokens."""
        return any(s.num_cached + q < s.num_tokens for s, q in zip(self.seqs, self.num_new))


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
                 decode_buckets: list[Bucket], prefill_chunk_size: int | None = None):
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
        self.prefill_chunk_size = prefill_chunk_size if prefill_chunk_size is not None \
            else config.prefill_chunk_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefilling: Sequence | None = None  # the sequence being prefilled chunk by chunk
        self._last_chunk_s = 0.0  # wall time of the last chunk step (reported by the engine)
        self._decode_s = 0.0  # decode time since the last chunk step
        self._decodes = 0  # decode steps since the last chunk step
        self.num_preemptions = 0
        self.num_chunks = 0

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
        if seq is self.prefilling:
            self.prefilling = None
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def add_running(self, seq: Sequence, after: Sequence) -> None:
        """A sequence forked from ``after`` (already holding its blocks) joins the running set."""
        seq.status = SequenceStatus.RUNNING
        self.running.insert(self.running.index(after) + 1, seq)

    def _weight(self, seq: Sequence) -> int:
        """Sequence slots a waiting sequence will occupy (its parallel samples fork from it)."""
        return 1 + seq.pending_forks

    def _num_running(self) -> int:
        return len(self.running)

    def schedule(self) -> ScheduledBatch | None:
        if self.prefilling is not None:
            # A long prompt is being prefilled in chunks: between two chunks the running
            # sequences decode (at least one step, and at least as long as a chunk took).
            if not self._decodable() or (self._decodes >= 1
                                         and self._decode_s >= CHUNK_DECODE_RATIO * self._last_chunk_s):
                return self._schedule_chunk()
            return self._schedule_decode()
        batch = self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
        return batch

    def _decodable(self) -> list[Sequence]:
        # (a beam whose logits are computed waits for its siblings' before it continues)
        return [s for s in self.running if s is not self.prefilling and s.num_cached < s.num_tokens]

    def note_step_time(self, batch: ScheduledBatch, seconds: float) -> None:
        """The engine reports each step's wall time (paces chunks against decodes)."""
        if batch.is_prefill and len(batch.seqs) == 1 and (batch.is_chunk or batch.bucket.kv_cache_size):
            self._last_chunk_s = seconds
        elif not batch.is_prefill:
            self._decode_s += seconds

    def _schedule_chunk(self) -> ScheduledBatch:
        self._decode_s, self._decodes = 0.0, 0
        seq = self.prefilling
        left = seq.num_tokens - seq.num_cached
        q = min(self.prefill_chunk_size, left)
        if q == left:
            self.prefilling = None  # the last chunk: the sequence decodes from the next step on
        ctx = seq.num_cached
        # furiosa's chunk buckets (attention = ctx + chunk, kv = ctx); never padded
        bucket = Bucket(1, ctx + q, ctx) if ctx else Bucket.prefill(1, q)
        self.num_chunks += 1
        return ScheduledBatch(bucket, [seq], prefill=True, num_new=[q])

    def _schedule_prefill(self) -> ScheduledBatch | None:
        busy = sum(1 + s.pending_forks for s in self.running)
        room = min(self.config.max_processing_samples - busy, self.max_decode_batch - busy)
        max_seqs = self.blocks.block_tables.shape[0]
        chosen: list[Sequence] = []
        longest, real_tokens, used_blocks, weight = 0, 0, 0, 0
        bucket = None
        chunk = self.prefill_chunk_size
        for looked, seq in enumerate(self.waiting):
            # FIFO for the head of the queue; later prompts may join it when they fit its
            # shape (grouping similar lengths), looking a bounded way ahead.
            if len(chosen) >= self.max_prefill_batch or looked >= PREFILL_LOOKAHEAD:
                break
            w = self._weight(seq)
            if weight + w > room and (chosen or self.running):
                break
            n = seq.num_tokens
            cached, taken = self.blocks.admission(seq, n)
            q = n - cached  # tokens to compute
            # Reserve the spare blocks for running sequences, and one block per running
            # sequence so admitting prompts does not immediately force preemption.
            # (With nothing running there is nothing to reserve for.)
            reserve = 0 if not self.running and not chosen else \
                self.spare_blocks + (len(self.running) if not self.config.is_offline else 0)
            need = taken + (1 if n % self.blocks.block_size == 0 else 0)
            if not self.blocks._free_slots or used_blocks + need + reserve > self.blocks.num_free_blocks \
                    or len(self.running) + weight + w > max_seqs:
                break
            if chunk is not None and q > chunk:
                if chosen:
                    break  # a long prompt goes alone, next step
                self.waiting.remove(seq)
                self._admit(seq)
                self.prefilling = seq
                return self._schedule_chunk()
            cand = smallest_bucket(self.prefill_buckets, len(chosen) + 1, max(longest, q))
            if cand is None:
                if not chosen and (seq.output_token_ids or q < n):
                    # A preempted sequence longer than any prompt bucket is recomputed alone
                    # (fx graphs are shape-dynamic; the bucket only fixes the padding).
                    chosen, bucket = [seq], Bucket.prefill(1, q)
                    break
                continue
            # Padded tokens cost as much compute as real ones: batch prompts while the padding
            # stays under 25%, or while the whole step is small enough to be overhead-bound.
            area = cand.batch_size * cand.attention_size
            if chosen and area > PREFILL_SMALL_STEP_TOKENS and area > 1.25 * (real_tokens + q) \
                    and area > bucket.batch_size * bucket.attention_size:
                continue
            chosen.append(seq)
            bucket = cand
            longest, real_tokens, used_blocks, weight = max(longest, q), real_tokens + q, used_blocks + need, weight + w
        if not chosen:
            return None
        for seq in chosen:
            self.waiting.remove(seq)
            self._admit(seq)
        batch = ScheduledBatch(bucket, chosen, prefill=True)
        if max(batch.num_new) > bucket.input_ids_size:  # the prefix cache changed in between (cannot happen)
            batch.bucket = Bucket.prefill(len(chosen), max(batch.num_new))
        return batch

    def _admit(self, seq: Sequence) -> None:
        self.blocks.allocate(seq, seq.num_tokens)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _schedule_decode(self) -> ScheduledBatch | None:
        if not self.running:
            if self.waiting:
                head = self.waiting[0]
                raise RuntimeError(
                    f"request {head.request_id} ({head.num_tokens} tokens) cannot be scheduled: the KV cache has "
                    f"{self.blocks.num_usable_blocks} usable blocks of {self.blocks.block_size} tokens; raise "
                    "paged_attention_num_blocks or kv_cache_memory_bytes")
            return None
        seqs = self._decodable()[: self.max_decode_batch]
        while not self.blocks.can_append(seqs):
            victim = self.running[-1]
            if len(self.running) == 1:
                raise RuntimeError("the KV cache is too small for a single sequence's context")
            self._preempt(victim)
            seqs = self._decodable()[: self.max_decode_batch]
        if not seqs:
            if self.prefilling is not None:  # only the chunked prefill is running
                return self._schedule_chunk()
            if self.waiting:  # beams wait for a preempted sibling that needs the blocks they hold
                self._preempt(self.running[-1])
                return self._schedule_prefill()
            return None
        self.blocks.may_append(seqs)
        self._decodes += 1
        longest = max(s.num_tokens for s in seqs)
        bucket = smallest_bucket(self.decode_buckets, len(seqs), longest)
        if bucket is None:  # cannot happen: lengths are validated against max_context on admission
            raise RuntimeError(f"no decode bucket for batch {len(seqs)} and context {longest}")
        return ScheduledBatch(bucket, seqs, prefill=False, num_new=[1] * len(seqs))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.pending_logits = None
        if seq is self.prefilling:
            self.prefilling = None
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        log.info("preempted %s (recompute %d tokens later)", seq.request_id, seq.num_tokens)
