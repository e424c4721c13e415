"""Scheduler: bucket choice, prefill preference, admission limits, preemption by recompute."""
from __future__ import annotations

from fxcompiler.config import SchedulerConfig
from fxcompiler.pipeline import Bucket
from fxcompiler.sampling_params import SamplingParams
from runtime.block_manager import BlockManager
from runtime.scheduler import Scheduler, smallest_bucket
from runtime.sequence import Sequence, SequenceStatus

PREFILL = [Bucket.prefill(b, a) for b in (1, 2, 4) for a in (16, 32, 64)]
DECODE = [Bucket.decode(b, 128) for b in (1, 2, 4, 8)]


def make(num_blocks=64, block_size=4, config=None):
    bm = BlockManager(num_blocks, block_size, max_seqs=16, max_blocks_per_seq=32)
    return Scheduler(config or SchedulerConfig(), bm, PREFILL, DECODE), bm


def seq(rid, n):
    return Sequence(rid, 0, list(range(1, n + 1)), SamplingParams(max_tokens=50), 0)


def test_smallest_bucket():
    assert smallest_bucket(PREFILL, 3, 20) == Bucket.prefill(4, 32)
    assert smallest_bucket(PREFILL, 1, 64) == Bucket.prefill(1, 64)
    assert smallest_bucket(PREFILL, 5, 10) is None


def test_prefill_first_then_decode():
    sch, _ = make()
    for i, n in enumerate((10, 12, 9)):
        sch.add(seq(f"r{i}", n))
    batch = sch.schedule()
    assert batch.is_prefill and len(batch.seqs) == 3 and batch.bucket == Bucket.prefill(4, 16)
    for s in batch.seqs:
        s.output_token_ids.append(0)
    batch = sch.schedule()
    assert not batch.is_prefill and batch.bucket == Bucket.decode(4, 128)
    assert all(s.status is SequenceStatus.RUNNING for s in batch.seqs)


def test_max_processing_samples_limits_admission():
    sch, _ = make(config=SchedulerConfig(max_processing_samples=2))
    for i in range(4):
        sch.add(seq(f"r{i}", 8))
    assert len(sch.schedule().seqs) == 2
    assert len(sch.waiting) == 2
    for s in sch.running:
        s.output_token_ids.append(0)
    assert not sch.schedule().is_prefill  # no room: decode the running ones


def test_preemption_recomputes_newest_and_frees_blocks():
    sch, bm = make(num_blocks=7, block_size=4)  # 6 usable blocks
    a, b = seq("a", 8), seq("b", 8)  # 2 blocks each (+1 reserved for the next token's block)
    sch.add(a)
    sch.schedule()
    a.output_token_ids.append(0)
    sch.add(b)
    batch = sch.schedule()
    assert batch.is_prefill and batch.seqs == [b]
    b.output_token_ids.append(0)
    # grow both until the cache is exhausted: the newest (b) is preempted, a keeps running
    for _ in range(12):
        batch = sch.schedule()
        if b.status is SequenceStatus.WAITING:
            break
        for s in batch.seqs:
            s.output_token_ids.append(0)
    assert b.status is SequenceStatus.WAITING and sch.num_preemptions == 1 and b.slot == -1
    assert a.status is SequenceStatus.RUNNING
    sch.finish(a, "length")
    batch = sch.schedule()  # b comes back as a prefill of prompt + its generated tokens
    assert batch.is_prefill and batch.seqs == [b] and b.num_tokens > 8
    sch.finish(b, "length")
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_spare_blocks_ratio_holds_blocks_back():
    sch, bm = make(num_blocks=13, block_size=4, config=SchedulerConfig(spare_blocks_ratio=0.5))  # 12 usable, 6 spare
    a, b = seq("a", 16), seq("b", 8)  # 5 and 3 blocks (prompt + next token)
    sch.add(a)
    sch.add(b)
    first = sch.schedule()  # nothing runs yet: no reserve applies to the first prompt
    assert first.is_prefill and first.seqs[0] is a
    if b not in first.seqs:  # b was not batched with a: it must wait while a decodes (7 free < 3 + 6 + 1)
        a.output_token_ids.append(0)
        assert not sch.schedule().is_prefill and b.status is SequenceStatus.WAITING
    without = make(num_blocks=13, block_size=4)[0]
    without.add(seq("a", 16))
    without.schedule()
    without.running[0].output_token_ids.append(0)
    without.add(seq("b", 8))
    assert without.schedule().is_prefill  # the same b is admitted at once without spare blocks


def _advance(batch):
    """What the runner and engine do: tokens computed; a finished prefill or a decode samples one token."""
    for s, q in zip(batch.seqs, batch.num_new):
        s.num_cached += q
        if s.num_cached == s.num_tokens:
            s.output_token_ids.append(0)


def test_chunked_prefill_paced_against_decodes(monkeypatch):
    monkeypatch.setattr("runtime.scheduler.CHUNK_DECODE_RATIO", 1.0)
    sch, _ = make(num_blocks=64, block_size=4)
    sch.prefill_chunk_size = 16
    a = seq("a", 8)
    sch.add(a)
    _advance(sch.schedule())  # a: whole prompt
    long = seq("long", 60)
    sch.add(long)
    kinds = []
    for _ in range(40):
        batch = sch.schedule()
        kinds.append("c" if batch.is_prefill else "d")
        chunk = batch.is_prefill
        _advance(batch)
        sch.note_step_time(batch, 0.3 if chunk else 0.1)  # a chunk takes three decode steps' time
        if long.num_cached >= 60:
            break
    assert kinds == ["c", "d", "d", "d", "c", "d", "d", "d", "c", "d", "d", "d", "c"]
    assert [s for s in sch.running] == [a, long] and long.output_token_ids == [0]
    assert sch.num_chunks == 4 and sch.prefilling is None
    # without timings chunks and decodes alternate
    sch2, _ = make()
    sch2.prefill_chunk_size = 16
    b = seq("b", 8)
    sch2.add(b)
    _advance(sch2.schedule())
    sch2.add(seq("long", 40))
    kinds = []
    for _ in range(5):
        batch = sch2.schedule()
        kinds.append("c" if batch.is_prefill else "d")
        _advance(batch)
    assert kinds == ["c", "d", "c", "d", "c"]


def test_prefix_hits_shrink_the_prefill():
    bm = BlockManager(64, 4, max_seqs=16, max_blocks_per_seq=32, enable_prefix_caching=True)
    sch = Scheduler(SchedulerConfig(), bm, PREFILL, DECODE)
    a = seq("a", 30)
    sch.add(a)
    batch = sch.schedule()
    _advance(batch)
    bm.commit(a)
    b = Sequence("b", 0, list(range(1, 29)) + [99, 98, 97], SamplingParams(max_tokens=5), 0)
    sch.add(b)
    batch = sch.schedule()
    assert batch.is_prefill and batch.num_new == [31 - 28] and b.num_cached == 28
    assert batch.bucket == Bucket.prefill(1, 16)
