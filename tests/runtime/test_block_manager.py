"""BlockManager: allocation, growth at block boundaries, freeing, null block, exhaustion."""
from __future__ import annotations

import pytest
import torch

from fxcompiler.sampling_params import SamplingParams
from runtime.block_manager import NULL_BLOCK, BlockManager, PagedKVCache
from runtime.sequence import Sequence


def seq(n_tokens: int, rid: str = "r") -> Sequence:
    return Sequence(rid, 0, list(range(1, n_tokens + 1)), SamplingParams(), 0)


def test_allocate_grow_free():
    bm = BlockManager(num_blocks=10, block_size=4, max_seqs=4, max_blocks_per_seq=8)
    assert bm.num_usable_blocks == 9 and bm.num_free_blocks == 9
    s = seq(5)
    bm.allocate(s, s.num_tokens)
    assert bm.num_seq_blocks[s.slot] == 2 and bm.num_free_blocks == 7
    assert NULL_BLOCK not in bm.block_tables[s.slot, :2].tolist()
    for _ in range(3):  # tokens 6..8 fit the second block
        s.output_token_ids.append(0)
        bm.may_append([s])
    assert bm.num_seq_blocks[s.slot] == 2
    s.output_token_ids.append(0)  # token 9 needs a third block
    bm.may_append([s])
    assert bm.num_seq_blocks[s.slot] == 3 and bm.num_free_blocks == 6
    slot = s.slot
    bm.free(s)
    assert s.slot == -1 and bm.num_free_blocks == 9
    assert bm.block_tables[slot].tolist() == [NULL_BLOCK] * 8


def test_exhaustion_and_limits():
    bm = BlockManager(num_blocks=4, block_size=4, max_seqs=2, max_blocks_per_seq=3)
    a, b = seq(8, "a"), seq(4, "b")
    assert bm.can_allocate(8) and not bm.can_allocate(13)
    bm.allocate(a, 8)
    assert not bm.can_allocate(5)
    bm.allocate(b, 4)
    with pytest.raises(RuntimeError, match="out of KV cache blocks"):
        bm.allocate(seq(1, "c"), 1)
    with pytest.raises(ValueError, match="needs 4 blocks"):
        BlockManager(20, 4, 2, 3).allocate(seq(13), 13)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockManager(1, 4, 1, 1)


def test_kv_cache_layout_is_per_layer_views_of_one_zeroed_buffer():
    kv = PagedKVCache(num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                      device=torch.device("cpu"))
    assert len(kv.k) == len(kv.v) == 3
    assert kv.k[0].shape == (5, 4, 2, 8) and kv.k[2].is_contiguous()
    assert all(float(t.abs().sum()) == 0 for t in kv.k + kv.v)
    kv.k[1].fill_(1)
    assert float(kv.k[0].sum()) == 0 and float(kv.v[1].sum()) == 0
    assert PagedKVCache.bytes_per_block(3, 4, 2, 8, torch.bfloat16) == 2 * 3 * 4 * 2 * 8 * 2
