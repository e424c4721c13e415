"""The CPU fused kernels on bf16 tensors compute exactly what transformers computes in a bf16
model (``auto_bfloat16_cast`` relies on it for its teacher-forced agreement)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.cpu import attention

pytestmark = pytest.mark.skipif(not attention.install(), reason="no C++ compiler / AVX2 on this machine")


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), tokens=st.integers(1, 70), hidden=st.sampled_from([7, 16, 64, 100, 576, 960, 1040, 4100]),
       eps=st.sampled_from([1e-5, 1e-6]), seed=st.integers(0, 2**16))
def test_rms_norm_bf16_is_bit_identical_to_transformers(batch, tokens, hidden, eps, seed):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, tokens, hidden, generator=g) * 4).to(torch.bfloat16)
    x[..., 0] = 200.0  # an outlier channel, as real hidden states have
    norm = LlamaRMSNorm(hidden, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=g) * 2)
    norm.to(torch.bfloat16)
    with torch.no_grad():
        expected = norm(x)
    got = torch.ops.fxc.rms_norm(x, norm.weight.detach(), eps)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 4), s=st.integers(1, 9), d=st.sampled_from([8, 64]),
       seed=st.integers(0, 2**16))
def test_silu_mul_and_rope_bf16_equal_transformers_ops(b, h, s, d, seed):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(b, s, d, generator=g).to(torch.bfloat16) for _ in range(2))
    assert torch.equal(torch.ops.fxc.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)
    q, k = (torch.randn(b, h, s, d, generator=g).to(torch.bfloat16) for _ in range(2))
    cos, sin = (torch.randn(b, s, d, generator=g).to(torch.bfloat16) for _ in range(2))
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(torch.ops.fxc.rope(q, cos.unsqueeze(1), sin.unsqueeze(1)), q_ref)
    assert torch.equal(torch.ops.fxc.rope(k, cos.unsqueeze(1), sin.unsqueeze(1)), k_ref)


def test_silu_mul_bf16_is_bit_identical_for_every_bf16_gate():
    """silu(gate) depends on one bf16 value: all 65536 of them (inf, NaN, subnormals included), at every
    position of a vector and in the tail, against ATen's F.silu(gate) * up."""
    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for n_extra in (0, 5):
        gate = torch.cat([every, every[:n_extra]])
        for up in (torch.ones_like(gate), torch.randn(gate.shape, generator=g).to(torch.bfloat16)):
            expected = torch.nn.functional.silu(gate) * up
            got = torch.ops.fxc.silu_mul(gate, up)
            same = (got.view(torch.int16) == expected.view(torch.int16)) | (got.isnan() & expected.isnan())
            assert bool(same.all()), gate[~same][:8]


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 9), s=st.integers(1, 5), d=st.sampled_from([2, 8, 34, 64, 128]),
       contiguous=st.booleans(), seed=st.integers(0, 2**16))
def test_rope_bf16_is_bit_identical_to_reference(b, h, s, d, contiguous, seed):
    from fxcompiler.ops.fused import rope_reference

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, h, d, generator=g).to(torch.bfloat16).transpose(1, 2)  # strided like transformers' q/k
    if contiguous:
        x = x.contiguous()
    cos = (torch.randn(b, 1, s, d, generator=g) * 2).to(torch.bfloat16)
    sin = (torch.randn(b, 1, s, d, generator=g) * 1e-2).to(torch.bfloat16)
    got = torch.ops.fxc.rope(x, cos, sin)
    assert got.dtype == torch.bfloat16 and torch.equal(got, rope_reference(x, cos, sin))


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 3), s=st.integers(1, 9), h=st.sampled_from([1, 15, 64, 1536]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_silu_mul_reads_the_halves_of_a_fused_projection_in_place(b, s, h, dtype, seed):
    """gate/up as split halves of one [.., 2h] tensor (row stride 2h): same result as on copies."""
    g = torch.Generator().manual_seed(seed)
    fused = (torch.randn(b, s, 2 * h, generator=g) * 3).to(dtype)
    gate, up = fused.split([h, h], dim=-1)
    expected = torch.nn.functional.silu(gate.contiguous()) * up.contiguous()
    got = torch.ops.fxc.silu_mul(gate, up)
    assert got.shape == gate.shape and got.is_contiguous()
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)
