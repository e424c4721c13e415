"""ModelRunner.prepare_decode: the step inputs of a decode batch, against a per-sequence reference on
hypothesis-generated batches of real BlockManager sequences (block growth, forks, mixed lengths)."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxcompiler.sampling_params import SamplingParams
from runtime.block_manager import BlockManager
from runtime.model_runner import ModelRunner
from runtime.scheduler import ScheduledBatch
from runtime.sequence import Sequence


class _KV:
    k = [torch.zeros(1)]
    v = [torch.zeros(1)]


def _batch(seqs: list[Sequence]) -> ScheduledBatch:
    return ScheduledBatch(bucket=None, seqs=seqs, prefill=False, num_new=[1] * len(seqs))


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([1, 4, 16]),
       lengths=st.lists(st.tuples(st.integers(1, 70), st.integers(0, 40)), min_size=1, max_size=9),
       order=st.randoms(use_true_random=False))
def test_prepare_decode_matches_per_sequence_reference(block_size, lengths, order):
    bm = BlockManager(num_blocks=1 + sum(-(-(p + o) // block_size) for p, o in lengths), block_size=block_size,
                      max_seqs=len(lengths), max_blocks_per_seq=-(-110 // block_size))
    seqs = []
    for i, (n_prompt, n_out) in enumerate(lengths):
        s = Sequence(f"r{i}", 0, [1000 + i * 7 + j for j in range(n_prompt)], SamplingParams(), 0)
        bm.allocate(s, s.num_tokens)
        for j in range(n_out):  # generated tokens: the table grows at block boundaries
            s.output_token_ids.append(5000 + j)
            bm.may_append([s])
        seqs.append(s)
    order.shuffle(seqs)  # slots are not in batch order
    runner = ModelRunner({}, _KV(), bm, torch.device("cpu"))
    batch = _batch(seqs)
    ids, pos, _k, _v, table, slots, seq_lens, logits_idx = runner.prepare_decode(batch)

    n = len(seqs)
    width = -(-max(s.num_tokens for s in seqs) // block_size)
    assert table.shape == (n, width) and ids.shape == pos.shape == slots.shape == (n, 1)
    for t in (ids, pos, table, slots, seq_lens, logits_idx):
        assert t.dtype == torch.int64 and t.is_contiguous()
    for i, s in enumerate(seqs):
        p = s.num_tokens - 1
        assert ids[i, 0] == s.all_token_ids()[-1]
        assert pos[i, 0] == p and seq_lens[i] == s.num_tokens
        assert table[i].tolist() == bm.block_tables[s.slot, :width].tolist()
        assert slots[i, 0] == int(bm.block_tables[s.slot, p // block_size]) * block_size + p % block_size
        assert s.num_cached == s.num_tokens
    assert logits_idx.tolist() == list(range(n)) and batch.logit_rows == [(i, 1) for i in range(n)]
    # the table is the step's own copy: the block manager's later growth does not change it
    before = table.clone()
    bm.block_tables[seqs[0].slot, :] = 12345
    assert torch.equal(table, before)
