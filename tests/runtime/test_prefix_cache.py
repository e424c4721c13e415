"""BlockManager prefix cache and sharing: chained block hashes, reference counts, LRU eviction,
fork and copy-on-write."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


# -- property test: random allocate / decode / fork / free with a shadow KV cache ------------------------

OPS = st.lists(st.tuples(st.sampled_from(["new", "decode", "fork", "free"]), st.integers(0, 10 ** 6)),
               min_size=1, max_size=60)


@settings(max_examples=80, deadline=None)
@given(OPS, st.sampled_from([1, 2, 4]), st.booleans())
def test_block_tables_always_hold_each_sequences_tokens(ops, block_size, caching):
    """Whatever the interleaving, every live sequence reads back its own tokens through its block
    table (prefix hits, forks and copy-on-write included), and no block is lost or double-owned."""
    bm = BlockManager(num_blocks=40, block_size=block_size, max_seqs=12, max_blocks_per_seq=40,
                      enable_prefix_caching=caching)
    shadow: dict[int, list] = {}  # block -> token written at each offset (the "KV")
    live: list[Sequence] = []

    def write(s, start, end):
        toks = s.all_token_ids()
        for p in range(start, end):
            b = int(bm.block_tables[s.slot, p // block_size])
            shadow.setdefault(b, [None] * block_size)[p % block_size] = toks[p]

    def copies():
        for src, dst in bm.take_pending_copies():
            shadow[dst] = list(shadow.get(src, [None] * block_size))

    def check():
        bm.check_invariants()
        for s in live:
            toks = s.all_token_ids()
            got = [shadow[int(bm.block_tables[s.slot, p // block_size])][p % block_size] for p in range(s.num_cached)]
            assert got == toks[: s.num_cached]

    for op, r in ops:
        if op == "new":
            n = 1 + r % 9
            s = seq([(r >> (3 * i)) % 3 for i in range(n)], f"s{r}")  # small alphabet: shared prefixes
            if bm.blocks_to_allocate(s, n) > bm.num_free_blocks or not bm._free_slots:
                continue
            bm.allocate(s, n)
            write(s, s.num_cached, n)
            s.num_cached = n
            bm.commit(s)
            live.append(s)
        elif op == "decode" and live:
            s = live[r % len(live)]
            s.output_token_ids.append(r % 3)
            if not bm.can_append([s]) or bm.blocks_needed(s.num_tokens) > bm.max_blocks_per_seq:
                s.output_token_ids.pop()
                continue
            bm.may_append([s])
            copies()
            write(s, s.num_tokens - 1, s.num_tokens)
            s.num_cached = s.num_tokens
            bm.commit(s)
        elif op == "fork" and live and bm._free_slots:
            p = live[r % len(live)]
            c = seq(p.prompt_token_ids, p.request_id)
            c.output_token_ids = list(p.output_token_ids)
            bm.fork(p, c)
            live.append(c)
        elif op == "free" and live:
            bm.free(live.pop(r % len(live)))
        check()
    for s in live:
        bm.free(s)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_prefix_tokens_counts_cached_and_queued_leading_blocks():
    bm = BlockManager(num_blocks=32, block_size=4, max_seqs=8, max_blocks_per_seq=8, enable_prefix_caching=True)
    a = seq(range(1, 15), "a")  # 3 full blocks cached after its prefill
    run_prefill(bm, a)
    assert bm.prefix_tokens(list(range(1, 15))) == 12
    assert bm.prefix_tokens(list(range(1, 13))) == 8  # the last token's block is computed again
    assert bm.prefix_tokens([1, 2, 3, 4, 0, 6, 7, 8, 9, 10]) == 4  # the chain breaks at the second block
    assert bm.prefix_tokens([7, 7, 7, 7, 7]) == 0
    queued = seq([5] * 9 + [1], "q")  # not computed yet: its leading blocks will be, before a new prompt's
    assert bm.prefix_tokens([5] * 12) == 0
    assert bm.prefix_tokens([5] * 12, [queued]) == 8
    assert bm.prefix_tokens([5] * 4 + [6] * 8, [queued]) == 4
    bm.enable_prefix_caching = False
    assert bm.prefix_tokens(list(range(1, 15)), [queued]) == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=14), min_size=1, max_size=6),
       st.lists(st.integers(1, 3), min_size=1, max_size=14))
def test_prefix_tokens_predicts_the_prefill_hits(prefilled, prompt):
    """What prefix_tokens promises for a prompt is what admitting it reuses, on any cache state."""
    bm = BlockManager(num_blocks=64, block_size=2, max_seqs=8, max_blocks_per_seq=8, enable_prefix_caching=True)
    for i, toks in enumerate(prefilled):
        run_prefill(bm, seq(toks, f"p{i}"))
    want = bm.prefix_tokens(list(prompt))
    assert run_prefill(bm, seq(prompt, "new")) == want
