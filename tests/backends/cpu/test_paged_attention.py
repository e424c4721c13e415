"""The C++ fxc::paged_attention CPU kernel against the ATen reference (hypothesis over shapes)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from backends.cpu import _build, attention
from fxcompiler.ops.paged_attention import paged_attention_reference

# skipped only where no kernel can be built; where one can, a failed build fails test_kernel_built (and the rest)
pytestmark = pytest.mark.skipif(not _build.can_build(), reason="no C++ compiler / AVX2 on this machine")
INSTALLED = _build.can_build() and attention.install()


def test_kernel_built():
    assert INSTALLED, f"the attention kernel failed to build: {attention._state['error']}"


TOL = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}



def _random_case(g, batch, kv_heads, hq, head_dim, tokens, block_size, mb, dtype):
    """Random paged caches (two spare blocks), shuffled block tables of ``mb`` blocks a row, and this call's
    q (strided like transformers') / k / v."""
    nb = batch * mb + 2
    k_cache = torch.randn(nb, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(nb, block_size, kv_heads, head_dim, generator=g).to(dtype)
    table = (torch.randperm(nb - 1, generator=g)[: batch * mb] + 1).view(batch, mb)
    q = torch.randn(batch, tokens, hq, head_dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(batch, kv_heads, tokens, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, tokens, head_dim, generator=g).to(dtype)
    return k_cache, v_cache, table, q, k, v

@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 4), kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 3]),
       head_dim=st.sampled_from([16, 32, 64]), ctx=st.integers(1, 90), tokens=st.integers(1, 9),
       block_size=st.sampled_from([1, 4, 16]), window=st.sampled_from([-1, 5, 32]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_kernel_matches_reference(batch, kv_heads, group, head_dim, ctx, tokens, block_size, window, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hq = kv_heads * group
    total = ctx + tokens
    mb = -(-total // block_size)
    k_cache, v_cache, table, q, k, v = _random_case(g, batch, kv_heads, hq, head_dim, tokens, block_size, mb, dtype)
    # rows have different real lengths; the last row may be padding-like (shorter context)
    lens = torch.tensor([total - (i % 3) for i in range(batch)]).clamp(min=tokens)
    pos = lens.view(-1, 1) - tokens + torch.arange(tokens)
    slots = table.gather(1, pos // block_size) * block_size + pos % block_size
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    ref = paged_attention_reference(q, k, v, k_cache, v_cache, table, slots, pos, lens, head_dim ** -0.5, window)
    out = attention.paged_attention_cpu(q, k, v, kc2, vc2, table, slots, pos, lens, head_dim ** -0.5, window)
    assert torch.equal(k_cache, kc2) and torch.equal(v_cache, vc2)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


def _decode_case(lens, kv_heads, group, head_dim, block_size, dtype, seed, tokens=1):
    """Caches with shuffled block ids, one row per entry of `lens` (each row's real context length)."""
    g = torch.Generator().manual_seed(seed)
    batch, hq = len(lens), kv_heads * group
    mb = -(-max(lens) // block_size)
    k_cache, v_cache, table, q, k, v = _random_case(g, batch, kv_heads, hq, head_dim, tokens, block_size, mb, dtype)
    lens = torch.tensor(lens)
    pos = lens.view(-1, 1) - tokens + torch.arange(tokens)
    slots = table.gather(1, pos // block_size) * block_size + pos % block_size
    return q, k, v, k_cache, v_cache, table, slots, pos, lens


def _check_decode(case, scale, dtype, window=-1):
    """The decode kernel itself (the op takes it for one query token per sequence; it handles more)."""
    q, k, v, k_cache, v_cache, table, slots, pos, lens = case
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    ref = paged_attention_reference(q, k, v, k_cache, v_cache, table, slots, pos, lens, scale, window)
    out = attention.kernel_module().paged_attention_cpu(q, k, v, kc2, vc2, table, slots, pos, lens, scale, window,
                                                        0.0)
    assert torch.equal(k_cache, kc2) and torch.equal(v_cache, vc2)
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


@settings(max_examples=50, deadline=None)
@given(lens=st.lists(st.one_of(st.integers(1, 40), st.integers(1, 700)), min_size=1, max_size=6),
       kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 3, 4, 8]),
       head_dim=st.sampled_from([64, 128]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_decode_kernel_uneven_and_long_contexts(lens, kv_heads, group, head_dim, dtype, seed):
    """Decode (one token per row) with the model geometry's block size: lengths 1, non-multiples of 16 and
    long rows that the kernel splits between threads (log-sum-exp merge of the pieces)."""
    _check_decode(_decode_case(lens, kv_heads, group, head_dim, 16, dtype, seed), head_dim ** -0.5, dtype)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_decode_kernel_splits_rows_between_threads(threads, dtype):
    """One long row and one just long enough to be cut (batch 1: split into pieces per thread), several rows
    with a cut inside one, a row of length 1."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, lens in enumerate(([1000], [130], [300, 17, 1, 650], [1, 1, 1], [64, 64, 64, 64, 64])):
            _check_decode(_decode_case(lens, 3, 3, 64, 16, dtype, i), 0.125, dtype)
            _check_decode(_decode_case(lens, 2, 4, 128, 16, dtype, i, tokens=min(3, min(lens))), 0.09, dtype,
                          window=200)
    finally:
        torch.set_num_threads(old)


def test_op_dispatches_to_kernel_for_decode():
    assert attention._state["module"] is not None
    q = torch.randn(1, 4, 1, 16)
    k = torch.randn(1, 2, 1, 16)
    kc = torch.zeros(4, 16, 2, 16)
    out = torch.ops.fxc.paged_attention(q, k, k.clone(), kc, kc.clone(), torch.tensor([[1]]), torch.tensor([[16]]),
                                        torch.tensor([[0]]), torch.tensor([1]), 0.25)
    torch.testing.assert_close(out, k.repeat_interleave(2, dim=1).transpose(1, 2))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), hidden=st.sampled_from([7, 16, 64, 576]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_fused_kernels_match_references(rows, hidden, dtype, seed):
    from fxcompiler.ops.fused import rms_norm_reference, silu_mul_reference

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(torch.ops.fxc.rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), rtol=tol,
                               atol=tol)
    up = torch.randn(rows, hidden, generator=g).to(dtype)
    torch.testing.assert_close(torch.ops.fxc.silu_mul(x, up), silu_mul_reference(x, up), rtol=tol, atol=tol)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 4), s=st.integers(1, 9), d=st.sampled_from([8, 16, 64]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), seed=st.integers(0, 2**16),
       cos_shape=st.sampled_from(["b1sd", "11sd", "sd", "b1sd-strided"]))
def test_rope_kernel_is_bit_identical_to_reference(b, h, s, d, dtype, seed, cos_shape):
    """cos/sin broadcast from [B, 1, S, D] (the graphs'), [1, 1, S, D], [S, D], or strided along D."""
    from fxcompiler.ops.fused import rope_reference

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, h, d, generator=g).to(dtype).transpose(1, 2)  # strided like transformers' q/k
    shape = {"b1sd": (b, 1, s, d), "11sd": (1, 1, s, d), "sd": (s, d), "b1sd-strided": (b, 1, s, 2 * d)}[cos_shape]
    cos = torch.randn(*shape, generator=g).to(dtype)
    sin = torch.randn(*shape, generator=g).to(dtype)
    if cos_shape.endswith("strided"):
        cos, sin = cos[..., ::2], sin[..., ::2]
    assert torch.equal(torch.ops.fxc.rope(x, cos, sin), rope_reference(x, cos, sin))


def test_rope_kernel_rejects_cos_that_does_not_broadcast():
    x = torch.randn(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="does not broadcast"):
        torch.ops.fxc.rope(x, torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))


def _rope_tables(batch, tokens, head_dim, pos, dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = pos.to(torch.float32).unsqueeze(-1) * inv
    emb = torch.cat([ang, ang], -1)
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)  # [B, 1, S, D]


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 3), kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 3]),
       head_dim=st.sampled_from([16, 64]), ctx=st.integers(0, 150), tokens=st.integers(1, 7),
       rope=st.booleans(), window=st.sampled_from([-1, 24]), layout=st.sampled_from(["dense", "wide", "columns"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_qkv_kernel_equals_the_unfused_ops(batch, kv_heads, group, head_dim, ctx, tokens, rope, window, layout, dtype,
                                           seed):
    """fxc::qkv_paged_attention on CPU (decode kernel or flash kernel) computes exactly what the
    graph it replaces computes (head views of the fused projection, fxc::rope, fxc::paged_attention, view),
    writes the same cache rows, and stays within tolerance of the pure-ATen references."""
    from fxcompiler.ops.fused import rope_reference
    from fxcompiler.ops.paged_attention import qkv_paged_attention_reference, split_qkv_heads

    hq = kv_heads * group
    lens = [max(tokens, ctx + tokens - i % 2) for i in range(batch)]  # rows of different lengths
    _, _, _, k_cache, v_cache, table, slots, pos, lens = _decode_case(lens, kv_heads, group, head_dim, 16, dtype,
                                                                      seed, tokens=tokens)
    g = torch.Generator().manual_seed(seed + 1)
    width = (hq + 2 * kv_heads) * head_dim
    if layout == "dense":
        qkv = torch.randn(batch, tokens, width, generator=g).to(dtype)
    elif layout == "wide":  # a column slice of a wider projection: rows strided, columns unit-stride
        qkv = torch.randn(batch, tokens, width + 24, generator=g).to(dtype)[..., 8:8 + width]
    else:  # columns not unit-stride: the kernel's view chain fallback
        qkv = torch.randn(batch, width, tokens, generator=g).to(dtype).transpose(1, 2)
    cos, sin = _rope_tables(batch, tokens, head_dim, pos, dtype) if rope else (None, None)
    scale = head_dim ** -0.5
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(3)]
    fused = torch.ops.fxc.qkv_paged_attention(qkv, cos, sin, *caches[0], table, slots, pos, lens, hq, kv_heads, scale,
                                              window)
    q, k, v = split_qkv_heads(qkv, hq, kv_heads)
    if rope:
        q, k = torch.ops.fxc.rope(q, cos, sin), torch.ops.fxc.rope(k, cos, sin)
    unfused = torch.ops.fxc.paged_attention(q, k, v, *caches[1], table, slots, pos, lens, scale, window)
    assert fused.shape == (batch, tokens, hq * head_dim)
    assert torch.equal(fused, unfused.reshape(batch, tokens, -1))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    ref = qkv_paged_attention_reference(qkv, cos, sin, *caches[2], table, slots, pos, lens, hq, kv_heads, scale,
                                        window, rope=rope_reference, attention=paged_attention_reference)
    torch.testing.assert_close(fused.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(caches[0][0].float(), caches[2][0].float(), rtol=TOL[dtype], atol=TOL[dtype])


def test_qkv_kernel_rejects_bad_arguments():
    k_cache = torch.zeros(4, 16, 2, 8)
    args = (k_cache, k_cache.clone(), torch.ones(1, 1, dtype=torch.int64), torch.full((1, 1), 16),
            torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64))
    op = torch.ops.fxc.qkv_paged_attention
    with pytest.raises(RuntimeError, match="qkv must be"):
        op(torch.zeros(1, 64), None, None, *args, 4, 2, 0.3)
    with pytest.raises(RuntimeError, match="last dim 60 is not"):
        op(torch.zeros(1, 1, 60), None, None, *args, 4, 2, 0.3)
    with pytest.raises(RuntimeError, match="both cos and sin"):
        op(torch.zeros(1, 1, 64), torch.ones(1, 1, 1, 8), None, *args, 4, 2, 0.3)


# ---------------------------------------------------------------------------------------------------------------
# The flash kernel (multi-token calls: speculative verify, chunked prefill, prefill).

def _flash_case(prefixes, tokens, kv_heads, group, head_dim, block_size, dtype, seed, pad_rows=0):
    """Sequence i computes `tokens` query tokens after `prefixes[i]` cached ones (a chunk at an offset);
    its last `pad_rows` query tokens are padding as the engine builds it (position 0, slot 0 of the
    null block). Block tables are shuffled block ids."""
    g = torch.Generator().manual_seed(seed)
    batch, hq = len(prefixes), kv_heads * group
    lens = torch.tensor([p + tokens - pad_rows for p in prefixes])
    mb = -(-int(lens.max()) // block_size)
    k_cache, v_cache, table, q, k, v = _random_case(g, batch, kv_heads, hq, head_dim, tokens, block_size, mb, dtype)
    pos = torch.tensor(prefixes).view(-1, 1) + torch.arange(tokens)
    slots = table.gather(1, (pos // block_size).clamp(max=mb - 1)) * block_size + pos % block_size
    if pad_rows:
        pos[:, tokens - pad_rows:] = 0
        slots[:, tokens - pad_rows:] = 0
    return q, k, v, k_cache, v_cache, table, slots, pos, lens


# bf16 is checked against the fp32 reference on the same (exactly upcast) values: the kernel accumulates in fp32,
# so what remains is the rounding of its output to bf16 (2^-9 relative) and fp32 summation order.
FLASH_TOL = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 8e-3}


def _check_flash(case, scale, dtype, window=-1, softcap=0.0, sinks=None, fn=None):
    q, k, v, k_cache, v_cache, table, slots, pos, lens = case
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    wide = (lambda t: t.float()) if dtype == torch.bfloat16 else (lambda t: t)
    kr, vr = wide(k_cache), wide(v_cache)
    ref = paged_attention_reference(wide(q), wide(k), wide(v), kr, vr, table, slots, pos, lens, scale, window,
                                    softcap, None if sinks is None else wide(sinks))
    fn = fn or attention.kernel_module().paged_attention_flash
    out = fn(q, k, v, kc2, vc2, table, slots, pos, lens, scale, window, softcap, sinks)
    # every row written where the reference writes it (block 0 is the null block: padding rows all write its slot 0)
    assert torch.equal(kr[1:], wide(kc2)[1:]) and torch.equal(vr[1:], wide(vc2)[1:])
    assert out.shape == ref.shape and out.dtype == dtype
    # compared in float64: a float64 result rounded to fp32 first would turn 1e-16 differences into fp32 ulps
    torch.testing.assert_close(out.double(), ref.double(), rtol=FLASH_TOL[dtype], atol=FLASH_TOL[dtype])
    return out


@settings(max_examples=70, deadline=None)
@given(prefixes=st.lists(st.integers(0, 150), min_size=1, max_size=3), tokens=st.integers(1, 40),
       kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3, 4]), head_dim=st.sampled_from([8, 20, 64, 128]),
       block_size=st.sampled_from([1, 4, 16, 32]), window=st.sampled_from([-1, 5, 40]),
       softcap=st.sampled_from([0.0, 0.0, 2.5]), sinks=st.booleans(), pad=st.integers(0, 3),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), seed=st.integers(0, 2**16))
@example(prefixes=[33], tokens=32, kv_heads=2, group=4, head_dim=128, block_size=32, window=5, softcap=0.0, sinks=True,
         pad=0, dtype=torch.float64, seed=987)  # float64 rows that once were compared after rounding to fp32
def test_flash_kernel_matches_reference(prefixes, tokens, kv_heads, group, head_dim, block_size, window, softcap,
                                        sinks, pad, dtype, seed):
    """Any number of query tokens at any chunk offset (query_pos not starting at 0), GQA ratios 1/3/4, head dims
    that are and are not multiples of the vector width, block sizes 1..32, sliding window, logit softcap, sinks,
    padding query rows (position 0, the null block's slot) as the engine's prefill builds them."""
    pad = min(pad, tokens - 1)
    case = _flash_case(prefixes, tokens, kv_heads, group, head_dim, block_size, dtype, seed, pad_rows=pad)
    sink = (torch.randn(kv_heads * group, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype) if sinks \
        else None
    _check_flash(case, head_dim ** -0.5, dtype, window, softcap, sink)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_flash_kernel_splits_context_between_threads(threads, dtype):
    """Batch 1 with few tiles (a verify step of 5 or 9 tokens, a 40-token chunk) over a long context: the tiles'
    contexts are cut into pieces merged by log-sum-exp; also many tiles (a 130-token prefill) and a batch."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i, (prefixes, tokens, window, sinks) in enumerate((([1500], 5, -1, False), ([900], 9, -1, True),
                                                                ([700], 40, 300, False), ([0], 130, -1, False),
                                                                ([600, 3, 257], 9, -1, True))):
            case = _flash_case(prefixes, tokens, 3, 3, 64, 16, dtype, i)
            sink = torch.linspace(-1, 2, 9).to(dtype) if sinks else None
            _check_flash(case, 0.125, dtype, window, 0.0, sink)
    finally:
        torch.set_num_threads(old)


def test_flash_kernel_is_what_the_op_runs_for_multi_token_calls():
    """fxc::paged_attention on CPU: the flash kernel for several query tokens per sequence that fill its tiles
    (at least the module's threshold of query rows, tokens x GQA group, per KV head), the decode kernel for
    one token and for fewer rows; bit-identical to calling either directly."""
    mod = attention.kernel_module()
    limit = mod._set_flash_min_rows(15)
    mod._set_flash_min_rows(limit)
    assert limit == 15
    for tokens, group, prefix, flash in ((1, 3, 50, False), (2, 3, 30, False), (4, 3, 40, False), (5, 3, 136, True),
                                         (9, 3, 200, True), (40, 3, 17, True), (4, 4, 60, True), (1, 16, 60, False)):
        case = _flash_case([prefix, prefix // 2], tokens, 2, group, 64, 16, torch.float32, tokens)
        q, k, v, k_cache, v_cache, table, slots, pos, lens = case
        kernel = mod.paged_attention_flash if flash else mod.paged_attention_cpu
        direct = kernel(q, k, v, k_cache.clone(), v_cache.clone(), table, slots, pos, lens, 0.125, -1, 0.0)
        op = torch.ops.fxc.paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), table, slots, pos, lens, 0.125)
        assert torch.equal(op, direct), (tokens, group)
