"""Micro-batches of a pipeline-parallel step (``runtime.workers.split_step_arrays``): whole rows,
in order, each keeping the logits indices of its rows, so the concatenated micro-batch logits are
the step's."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.workers import micro_batch_rows, split_step_arrays


@st.composite
def steps(draw):
    B = draw(st.integers(1, 9))
    T = draw(st.integers(1, 7))
    width = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids = rng.integers(0, 1000, (B, T))
    logits_idx = []
    for i in range(B):  # per row: its last token, or every token (prompt logprobs / a verify step)
        q = draw(st.integers(1, T))
        logits_idx.extend(range(i * T, i * T + q) if draw(st.booleans()) else [i * T + q - 1])
    arrays = [ids, rng.integers(0, 64, (B, T)), rng.integers(0, 9, (B, width)), rng.integers(0, 99, (B, T)),
              rng.integers(1, 64, B), np.array(logits_idx, dtype=np.int64)]
    return arrays, draw(st.integers(1, 12))


def _logits(arrays):
    """What an executable's logits rows are, per index: the token at that flat position (and its row's length)."""
    ids, _pos, _table, _slots, seq_lens, idx = arrays
    T = ids.shape[1]
    return np.stack([ids.reshape(-1)[idx], seq_lens[idx // T]], axis=1)


@settings(max_examples=200, deadline=None)
@given(steps())
def test_micro_batches_are_whole_rows_whose_logits_concatenate_to_the_step(step):
    arrays, m = step
    parts = split_step_arrays(arrays, m)
    B = arrays[0].shape[0]
    assert len(parts) == min(m, B)
    sizes = [p[0].shape[0] for p in parts]
    assert sum(sizes) == B and max(sizes) - min(sizes) <= 1
    for k in range(5):  # the per-row arrays, cut and in order
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), arrays[k])
    for p in parts:  # every micro-batch has logits to return (each row has at least one index)
        assert len(p[5]) >= p[0].shape[0] and (p[5] >= 0).all() and (p[5] < p[0].size).all()
    np.testing.assert_array_equal(np.concatenate([_logits(p) for p in parts]), _logits(arrays))


@pytest.mark.parametrize("rows,m,want", [(5, 2, [(0, 3), (3, 5)]), (1, 4, [(0, 1)]), (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
                                          (7, 1, [(0, 7)]), (3, 0, [(0, 3)])])
def test_micro_batch_rows(rows, m, want):
    assert micro_batch_rows(rows, m) == want
