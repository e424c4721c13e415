"""``fxc::apply_token_bitmask`` (structured output's grammar mask) against its ATen reference, bit for bit."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.cpu import attention
from fxcompiler.ops.sampling import apply_token_bitmask_reference, unpack_token_bitmask

pytestmark = pytest.mark.skipif(not attention.install(), reason="no C++ compiler / AVX2 on this machine")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN payloads included)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@settings(max_examples=80, deadline=None)
@given(batch=st.integers(1, 7), vocab=st.integers(1, 200), dtype=st.sampled_from([torch.float32, torch.bfloat16,
                                                                                   torch.float64]),
       density=st.sampled_from([0.0, 0.1, 0.5, 1.0]), seed=st.integers(0, 2**16), data=st.data())
def test_matches_the_reference(batch, vocab, dtype, density, seed, data):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, vocab, generator=g) * 5).to(dtype)
    x[0, 0] = float("nan") if vocab > 1 else x[0, 0]  # masked or kept as it is, like masked_fill
    rows = data.draw(st.lists(st.integers(0, batch - 1), unique=True, max_size=batch))
    words = (vocab + 31) // 32
    bits = torch.rand(len(rows), words * 32, generator=g) < density
    bitmask = torch.zeros(len(rows), words, dtype=torch.int64)
    for k in range(32):  # pack: bit k of each word
        bitmask |= bits[:, k::32].long() << k
    bitmask = bitmask.to(torch.int32) if not len(rows) else (bitmask - (bitmask >> 31 << 32)).to(torch.int32)
    r = torch.tensor(rows, dtype=torch.long)
    got = torch.ops.fxc.apply_token_bitmask(x, bitmask, r)
    want = apply_token_bitmask_reference(x, bitmask, r)
    assert got.dtype == x.dtype and _same_bits(got, want)
    allowed = unpack_token_bitmask(bitmask, vocab)
    for j, row in enumerate(rows):  # the packing and the reference agree on which tokens survive
        assert torch.equal(torch.isneginf(got[row]) & ~torch.isneginf(x[row]), ~allowed[j] & ~torch.isneginf(x[row]))
    untouched = [b for b in range(batch) if b not in rows]
    assert _same_bits(got[untouched], x[untouched])
    assert got.data_ptr() != x.data_ptr()  # a copy: the input is unchanged


def test_bad_arguments_name_the_argument():
    x = torch.zeros(2, 40)
    with pytest.raises((ValueError, RuntimeError), match="bitmask must be int32"):
        torch.ops.fxc.apply_token_bitmask(x, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]))
    with pytest.raises((ValueError, RuntimeError), match="rows must be int64"):
        torch.ops.fxc.apply_token_bitmask(x, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match=r"rows\[0\]=5 is outside"):
        torch.ops.fxc.apply_token_bitmask(x, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5]))
