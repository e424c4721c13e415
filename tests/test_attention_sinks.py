"""Attention sinks (GPT-OSS) in ``fxc::paged_attention``: reference against a direct softmax, C++ kernel
against the reference (decode rows, a row long enough to be split between threads, prefill)."""
from __future__ import annotations

import pytest
import torch

from fxcompiler.ops.paged_attention import paged_attention_reference
from fxcompiler.testing import TestBucket as Bucket, inputs_for_geometry
from fxcompiler.capture import ModelGeometry


def _case(batch, tokens, context, dtype=torch.float32, hq=4, hkv=2, d=16, seed=0):
    g = ModelGeometry(1, hkv, d, 50, dtype, 4096)
    inp = inputs_for_geometry(g, Bucket(batch, tokens, context, 16), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(batch, hq, tokens, d, generator=gen).to(dtype)
    k = torch.randn(batch, hkv, tokens, d, generator=gen).to(dtype)
    v = torch.randn(batch, hkv, tokens, d, generator=gen).to(dtype)
    sinks = (torch.randn(hq, generator=gen) * 2).to(dtype)
    args = (q, k, v, inp["k_cache_0"], inp["v_cache_0"], inp["block_table"], inp["slot_mapping"],
            inp["position_ids"], inp["seq_lens"], d ** -0.5)
    return args, sinks


def test_reference_sinks_match_explicit_softmax():
    (q, k, v, kc, vc, table, slots, pos, lens, scale), sinks = _case(2, 3, 5, torch.float64)
    out = paged_attention_reference(q, k, v, kc.clone(), vc.clone(), table, slots, pos, lens, scale, -1, 0.0, sinks)
    base = paged_attention_reference(q, k, v, kc.clone(), vc.clone(), table, slots, pos, lens, scale)
    assert not torch.allclose(out, base)  # sinks change the result
    kc2, vc2 = kc.clone(), vc.clone()
    paged_attention_reference(q, k, v, kc2, vc2, table, slots, pos, lens, scale)
    for b in range(2):
        ctx = int(lens[b])
        blocks = table[b]
        kr = kc2[blocks].reshape(-1, 2, 16)[:ctx]  # [ctx, Hkv, D]
        vr = vc2[blocks].reshape(-1, 2, 16)[:ctx]
        for h in range(4):
            for s in range(3):
                p = int(pos[b, s])
                logits = (kr[: p + 1, h // 2] @ q[b, h, s]) * scale
                w = torch.softmax(torch.cat([logits, sinks[h:h + 1]]), 0)[:-1]
                torch.testing.assert_close(out[b, s, h], w @ vr[: p + 1, h // 2])


@pytest.mark.parametrize("batch,tokens,context", [(3, 1, 20), (1, 1, 300), (2, 6, 30)])
@pytest.mark.parametrize("window", [-1, 8])
def test_cpu_kernel_sinks_match_reference(batch, tokens, context, window):
    from backends.cpu import attention

    mod = attention.kernel_module()
    if mod is None:
        from backends.cpu import _build

        if not _build.can_build():
            pytest.skip("no C++ toolchain / AVX2 here: the ATen reference is what runs")
        pytest.fail(f"the attention kernel failed to build on a machine that can build it: {attention._state['error']}")
    args, sinks = _case(batch, tokens, context)
    q, k, v, kc, vc, *rest = args
    want = paged_attention_reference(q, k, v, kc.clone(), vc.clone(), *rest, window, 0.0, sinks)
    got = mod.paged_attention(q, k, v, kc.clone(), vc.clone(), *rest, window, 0.0, sinks)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    without = mod.paged_attention(q, k, v, kc.clone(), vc.clone(), *rest, window, 0.0)
    assert not torch.allclose(without, want, atol=1e-4)
