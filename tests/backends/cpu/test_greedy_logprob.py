"""``fxc::greedy_logprob`` (the greedy sampler's op) against its ATen reference, and the C++
registration of the CPU kernels."""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.cpu import attention
from fxcompiler.ops.sampling import greedy_logprob_reference

pytestmark = pytest.mark.skipif(not attention.install(), reason="no C++ compiler / AVX2 on this machine")


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), vocab=st.integers(1, 300), ties=st.integers(0, 3), neg_inf=st.booleans(),
       scale=st.sampled_from([1.0, 30.0]), seed=st.integers(0, 2**16))
def test_matches_the_reference(rows, vocab, ties, neg_inf, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * scale
    for r in range(rows):  # repeated maxima: the first index wins
        idx = torch.randint(0, vocab, (ties,), generator=g)
        x[r, idx] = x[r].max() + 1
    if neg_inf:
        x[:, torch.randint(0, vocab, (vocab // 3 + 1,), generator=g)] = float("-inf")
    tok, lp = torch.ops.fxc.greedy_logprob(x)
    ref_tok, ref_lp = greedy_logprob_reference(x)
    assert tok.dtype == torch.long and lp.dtype == torch.float32
    assert torch.equal(tok, ref_tok)
    truth = greedy_logprob_reference(x.double())[1]  # ours is no further from the float64 value than ATen's
    assert ((lp.double() - truth).abs().nan_to_num() <= (ref_lp.double() - truth).abs().nan_to_num() + 2e-6).all()
    assert torch.equal(lp.isnan(), ref_lp.isnan())


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), vocab=st.integers(1, 300), ties=st.integers(0, 3), neg_inf=st.booleans(),
       nan=st.booleans(), seed=st.integers(0, 2**16))
def test_bf16_logits_give_their_fp32_upcasts_result_bit_for_bit(rows, vocab, ties, neg_inf, nan, seed):
    """A bf16 checkpoint run in its own dtype returns bf16 logits; the greedy op reads them as the fp32
    values they are (no [B, V] fp32 copy first)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * 8).bfloat16()
    for r in range(rows):
        x[r, torch.randint(0, vocab, (ties,), generator=g)] = x[r].max()
    if neg_inf:
        x[:, torch.randint(0, vocab, (vocab // 3 + 1,), generator=g)] = float("-inf")
    if nan:
        x[0, torch.randint(0, vocab, (1,), generator=g)] = float("nan")
    tok, lp = torch.ops.fxc.greedy_logprob(x)
    ref_tok, ref_lp = torch.ops.fxc.greedy_logprob(x.float())
    assert torch.equal(tok, ref_tok) and torch.equal(lp.isnan(), ref_lp.isnan())
    assert torch.equal(lp.nan_to_num(), ref_lp.nan_to_num())
    assert torch.equal(tok, greedy_logprob_reference(x)[0])


def test_special_rows_and_other_dtypes():
    x = torch.randn(4, 4099)
    x[0, 17] = float("nan")
    x[0, 3000] = float("nan")
    x[1] = float("-inf")
    x[2, 4098] = 1e4  # maximum in the scalar tail
    tok, lp = torch.ops.fxc.greedy_logprob(x)
    ref_tok, ref_lp = greedy_logprob_reference(x)
    assert tok.tolist() == ref_tok.tolist() and tok[0] == 17 and tok[2] == 4098
    torch.testing.assert_close(lp, ref_lp, equal_nan=True)
    tok, lp = torch.ops.fxc.greedy_logprob(x[2:].double())  # the ATen path
    ref_tok, ref_lp = greedy_logprob_reference(x[2:].double())
    assert torch.equal(tok, ref_tok) and torch.equal(lp, ref_lp)
    xb = x.bfloat16()  # bf16 rows: the kernel on their (exact) fp32 upcast, bit for bit
    tok, lp = torch.ops.fxc.greedy_logprob(xb)
    ref_tok, ref_lp = torch.ops.fxc.greedy_logprob(xb.float())
    assert torch.equal(tok, ref_tok) and torch.equal(lp.isnan(), ref_lp.isnan()) and lp.dtype == torch.float32
    assert torch.equal(lp.nan_to_num(), ref_lp.nan_to_num())
    with pytest.raises(RuntimeError, match=r"\[B, V\]"):
        torch.ops.fxc.greedy_logprob(torch.zeros(2, 3, 4))


@pytest.mark.parametrize("op", ["paged_attention", "rms_norm", "silu_mul", "rope", "greedy_logprob", "apply_token_bitmask"])
def test_cpu_kernels_are_registered_in_cpp(op):
    """install() registers the C++ functions themselves: a call never passes through Python."""
    table = torch._C._dispatch_dump(f"fxc::{op}")
    cpu = [line for line in table.splitlines() if line.startswith("CPU:")]
    # the kernel cache builds a staged copy of csrc/paged_attention.cpp: "registered at .../paged_attention.cpp:LINE"
    assert len(cpu) == 1 and re.search(r"/paged_attention\.cpp:\d+", cpu[0]), table
