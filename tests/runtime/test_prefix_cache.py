"""BlockManager prefix cache and sharing: chained block hashes, reference counts, LRU eviction,
fork and copy-on-write."""
from __future__ import annotations

import torch

from fxcompiler.sampling_params import SamplingParams
from runtime.block_manager import BlockManager, PagedKVCache
from runtime.sequence import Sequence


def seq(tokens, rid="r", **params) -> Sequence:
    return Sequence(rid, 0, list(tokens), SamplingParams(**params), 0)


def run_prefill(bm, s):
    """What the runner and engine do around a prefill: all tokens computed, full blocks committed."""
    bm.allocate(s, s.num_tokens)
    cached = s.num_cached
    s.num_cached = s.num_tokens
    bm.commit(s)
    return cached


def test_chained_hashes_hit_leading_full_blocks_only():
    bm = BlockManager(num_blocks=32, block_size=4, max_seqs=8, max_blocks_per_seq=8, enable_prefix_caching=True)
    a = seq(range(1, 15), "a")  # 14 tokens: 3 full blocks
    assert run_prefill(bm, a) == 0 and bm.num_cached_blocks == 3
    b = seq(list(range(1, 13)) + [99, 98], "b")  # same first 3 blocks
    assert run_prefill(bm, b) == 12
    assert bm.block_tables[b.slot, :3].tolist() == bm.block_tables[a.slot, :3].tolist()
    assert bm.ref_counts[bm.block_tables[a.slot, :3]].tolist() == [2, 2, 2]
    c = seq([1, 2, 3, 4, 0, 6, 7, 8, 9, 10, 11, 12, 13], "c")  # second block differs: chain breaks there
    assert run_prefill(bm, c) == 4
    d = seq(range(5, 19), "d")  # block 2 of a's tokens at a different position: different chain
    assert run_prefill(bm, d) == 0
    e = seq(range(1, 13), "e")  # exactly 3 blocks: the last token's block is recomputed
    assert run_prefill(bm, e) == 8
    assert bm.prefix_queries == 14 + 14 + 13 + 14 + 12 and bm.prefix_hits == 12 + 4 + 8
    bm.check_invariants()


def test_prompt_logprobs_bypass_the_cache():
    bm = BlockManager(32, 4, 8, 8, enable_prefix_caching=True)
    run_prefill(bm, seq(range(1, 15), "a"))
    assert run_prefill(bm, seq(range(1, 15), "b", prompt_logprobs=1)) == 0


def test_freed_blocks_stay_cached_and_are_evicted_lru():
    bm = BlockManager(num_blocks=9, block_size=4, max_seqs=4, max_blocks_per_seq=8, enable_prefix_caching=True)
    a = seq(range(1, 10), "a")  # 3 blocks, 2 full
    run_prefill(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    b = seq(range(101, 110), "b")
    run_prefill(bm, b)
    bm.free(b)  # released after a's blocks: more recently used
    assert bm.num_cached_blocks == 4
    # 8 usable blocks, 4 of them cached and unreferenced: a 5-block request evicts the oldest (a's)
    c = seq(range(201, 221), "c")
    run_prefill(bm, c)
    assert bm.evictions == 1
    assert run_prefill(bm, seq(range(101, 110), "b2")) == 8  # b survived; its new block evicts a's other one
    assert bm.evictions == 2
    bm.check_invariants()
    bm.free(c)
    assert run_prefill(bm, seq(range(1, 10), "a2")) == 0  # a was evicted
    bm.check_invariants()


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=16, block_size=4, max_seqs=4, max_blocks_per_seq=8)
    kv = PagedKVCache(1, 16, 4, 1, 2, torch.float64, torch.device("cpu"))
    p = seq(range(1, 7), "p")  # 6 tokens: 2 blocks, the second half full
    bm.allocate(p, 6)
    p.num_cached = 6
    children = [seq(range(1, 7), "p") for _ in range(2)]
    for c in children:
        bm.fork(p, c)
    shared = bm.block_tables[p.slot, :2].tolist()
    assert bm.ref_counts[shared].tolist() == [3, 3] and bm.num_free_blocks == 13
    kv.k[0][shared[1]] = 7.0
    for s in [p] + children:  # each samples a token; its K/V goes to position 6 in block 1
        s.output_token_ids.append(0)
    assert bm.can_append([p] + children)
    bm.may_append([p] + children)
    copies = bm.take_pending_copies()
    assert len(copies) == 2 and bm.copies_on_write == 2  # two copies, the last writer keeps the original
    assert [src for src, _ in copies] == [shared[1]] * 2
    kv.copy_blocks(copies)
    lasts = {int(bm.block_tables[s.slot, 1]) for s in [p] + children}
    assert len(lasts) == 3 and all(float(kv.k[0][b].min()) == 7.0 for b in lasts)
    assert bm.ref_counts[shared[0]] == 3
    bm.check_invariants()
    for s in [p] + children:
        bm.free(s)
    assert bm.num_free_blocks == bm.num_usable_blocks
    bm.check_invariants()
