"""``fxc::embedding_w8`` / ``fxc::embedding_w4`` (fxcompiler/ops/quant_embedding.py): the gathered rows equal
the rows of the linear ops' own dequantisation bit for bit, for any ids shape, table size and group."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fxcompiler.ops  # noqa: F401  (registers the fxc ops)
from fxcompiler.ops.linear import dequantize_linear_weight_int8, quantize_linear_weight_int8
from fxcompiler.ops.quant_linear import dequantize_linear_weight_int4, fp16_if_exact, quantize_linear_weight_int4


def _ids(n: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, n, shape, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 100), k=st.sampled_from([32, 64, 96]), gs=st.sampled_from([-1, 32]),
       shape=st.sampled_from([(1,), (5,), (2, 3), (1, 1)]), seed=st.integers(0, 2**16))
def test_embedding_w8_rows_equal_the_linear_dequantisation(n, k, gs, shape, seed):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    packed, scales = quantize_linear_weight_int8(w, gs)
    table = dequantize_linear_weight_int8(packed, scales, n, gs)
    ids = _ids(n, shape, seed)
    out = torch.ops.fxc.embedding_w8(ids, packed, scales, n, gs)
    assert out.dtype == torch.float32 and out.shape == (*shape, k)
    assert torch.equal(out, torch.nn.functional.embedding(ids, table))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 100), k=st.sampled_from([32, 64, 96]), gs=st.sampled_from([32, 64]), half=st.booleans(),
       shape=st.sampled_from([(1,), (7,), (2, 3)]), seed=st.integers(0, 2**16))
def test_embedding_w4_rows_equal_the_linear_dequantisation(n, k, gs, half, shape, seed):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    packed, scales, mins = quantize_linear_weight_int4(w, gs)
    if half:  # GGUF-style fp16 scales and mins (exact fp16 values), the layout native Q4_0/Q4_1 blocks get
        scales, mins = scales.half().float(), mins.half().float()
        scales, mins = fp16_if_exact(scales, mins)
    table = dequantize_linear_weight_int4(packed, scales, mins, n, gs)
    ids = _ids(n, shape, seed)
    out = torch.ops.fxc.embedding_w4(ids, packed, scales, mins, n, gs)
    assert out.dtype == torch.float32 and out.shape == (*shape, k)
    assert torch.equal(out, torch.nn.functional.embedding(ids, table))


@pytest.mark.parametrize("bad", [70, -1])
def test_embedding_ids_out_of_range_raise(bad):
    w = torch.randn(70, 32)
    packed, scales = quantize_linear_weight_int8(w, 32)  # 3 panels: rows 70..95 are padding
    with pytest.raises(IndexError, match="index out of range"):
        torch.ops.fxc.embedding_w8(torch.tensor([0, bad]), packed, scales, 70, 32)
    q4, s4, m4 = quantize_linear_weight_int4(w, 32)
    with pytest.raises(IndexError, match="index out of range"):
        torch.ops.fxc.embedding_w4(torch.tensor([bad]), q4, s4, m4, 70, 32)


def test_embedding_fake_kernels_give_the_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    w = torch.randn(40, 64)
    q8, s8 = quantize_linear_weight_int8(w, 32)
    q4, s4, m4 = quantize_linear_weight_int4(w, 32)
    with FakeTensorMode(allow_non_fake_inputs=True):
        ids = torch.empty(3, 5, dtype=torch.long)
        assert torch.ops.fxc.embedding_w8(ids, q8, s8, 40, 32).shape == (3, 5, 64)
        assert torch.ops.fxc.embedding_w4(ids, q4, s4, m4, 40, 32).shape == (3, 5, 64)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 100), k=st.sampled_from([32, 64, 96]), gs=st.sampled_from([32, 64, 128]), half=st.booleans(),
       per_row=st.booleans(), shape=st.sampled_from([(1,), (7,), (2, 3), (0,)]), int32=st.booleans(),
       seed=st.integers(0, 2**16))
def test_cpu_kernels_equal_the_references(n, k, gs, half, per_row, shape, int32, seed):
    """The C++ lookups (backends/cpu/csrc/quant_kernels.cpp) against the ATen references, bit for bit: ragged last
    groups (K = 96, group 64), fp16 group parameters, w8's per-row scales, int32 and empty ids."""
    from backends.cpu import quant
    from fxcompiler.ops import quant_embedding as qemb

    assert quant.ensure_loaded(), "the quantized CPU kernels did not build"
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    ids = _ids(n, shape, seed).to(torch.int32 if int32 else torch.int64)
    gs8 = -1 if per_row else (gs if k % gs == 0 else 32)  # the int8 packer wants groups dividing K
    p8, s8 = quantize_linear_weight_int8(w, gs8)
    if half and not per_row:
        s8 = s8.half()  # any fp16 scales: both sides upcast them exactly
    out8 = torch.ops.fxc.embedding_w8(ids, p8, s8, n, gs8)
    assert torch.equal(out8, qemb.embedding_w8_reference(ids, p8, s8, n, gs8))
    p4, s4, m4 = quantize_linear_weight_int4(w, gs)
    if half:
        s4, m4 = s4.half(), m4.half()
    out4 = torch.ops.fxc.embedding_w4(ids, p4, s4, m4, n, gs)
    assert torch.equal(out4, qemb.embedding_w4_reference(ids, p4, s4, m4, n, gs))
    assert out4.shape == (*shape, k) and out8.shape == (*shape, k)


def test_cpu_kernels_name_bad_arguments():
    from backends.cpu import quant

    assert quant.ensure_loaded()
    w = torch.randn(40, 64)
    p8, s8 = quantize_linear_weight_int8(w, 32)
    with pytest.raises(RuntimeError, match="ids must be an integer tensor"):
        torch.ops.fxc.embedding_w8(torch.tensor([1.0]), p8, s8, 40, 32)
    with pytest.raises(RuntimeError, match=r"scales must be \[P, G, 32\]"):
        torch.ops.fxc.embedding_w8(torch.tensor([1]), p8, s8[:, :1].contiguous(), 40, 32)
    with pytest.raises(RuntimeError, match="larger than the table"):
        torch.ops.fxc.embedding_w8(torch.tensor([1]), p8, s8, 65, 32)
    p4, s4, m4 = quantize_linear_weight_int4(w, 32)
    with pytest.raises(RuntimeError, match="mins must be contiguous float32 or float16"):
        torch.ops.fxc.embedding_w4(torch.tensor([1]), p4, s4, m4.double(), 40, 32)
