"""Sampler: processed distribution == transformers' processors/warpers, greedy, seeding, support."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from fxcompiler.sampling_params import SamplingParams
from runtime.sampler import Sampler, SamplingRow, apply_penalties_and_warpers

SETTINGS = settings(max_examples=60, deadline=None)


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Tiny tensors: intra-op threads only add barrier waits on a busy 2-core box."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@st.composite
def rows_st(draw, vocab: int, n: int, seeded: bool | None = None) -> list[SamplingRow]:
    rows = []
    for _ in range(n):
        maybe = lambda default, strat: draw(st.one_of(st.just(default), strat))  # noqa: E731
        seed = draw(st.integers(0, 2**31 - 1)) if seeded else (None if seeded is False else draw(st.none() | st.integers(0, 2**31 - 1)))
        params = SamplingParams(
            temperature=draw(st.sampled_from([0.0, 1.0, 0.3, 0.7, 1.3, 2.5]) | st.floats(0.05, 3.0)),
            top_k=maybe(-1, st.integers(1, vocab + 2)),
            top_p=maybe(1.0, st.floats(0.05, 1.0)),
            min_p=maybe(0.0, st.floats(0.0, 1.0)),
            repetition_penalty=maybe(1.0, st.floats(0.5, 2.0)),
            presence_penalty=maybe(0.0, st.floats(-2.0, 2.0)),
            frequency_penalty=maybe(0.0, st.floats(-2.0, 2.0)),
            min_tokens=draw(st.integers(0, 3)),
            logit_bias=draw(st.none() | st.dictionaries(st.integers(0, vocab - 1), st.floats(-5.0, 5.0), max_size=3)),
            logprobs=draw(st.none() | st.integers(0, 4)),
            seed=seed,
        )
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        rows.append(
            SamplingRow(
                params=params,
                prompt_token_ids=draw(st.lists(st.integers(0, vocab - 1), max_size=6)),
                output_token_ids=draw(st.lists(st.integers(0, vocab - 1), max_size=6)),
                eos_token_ids=draw(st.frozensets(st.integers(0, vocab - 1), max_size=min(2, vocab - 1))),
                generator=gen,
            )
        )
    return rows


@st.composite
def batch_st(draw, seeded: bool | None = None) -> tuple[torch.Tensor, list[SamplingRow]]:
    vocab = draw(st.integers(3, 40))
    n = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    scale = draw(st.sampled_from([0.5, 2.0, 6.0]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    logits = torch.randn(n, vocab, generator=g, dtype=dtype) * scale
    return logits, draw(rows_st(vocab, n, seeded))


def reference_row(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """One row [1, V] through transformers' own processors (vLLM formula for presence/frequency)."""
    p = row.params
    x = logits.clone()
    for t, v in (p.logit_bias or {}).items():
        x[0, t] += v
    ids = torch.tensor([list(row.prompt_token_ids) + list(row.output_token_ids)], dtype=torch.long)
    if row.eos_token_ids:
        proc = MinNewTokensLengthLogitsProcessor(len(row.prompt_token_ids), p.min_tokens, sorted(row.eos_token_ids))
        x = proc(ids, x)
    if p.repetition_penalty != 1.0 and ids.numel():
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    if p.presence_penalty or p.frequency_penalty:
        counts = torch.bincount(torch.tensor(list(row.output_token_ids), dtype=torch.long), minlength=x.shape[1])
        counts = counts.to(x.dtype)[None]
        x = x - torch.tensor(p.frequency_penalty, dtype=x.dtype) * counts
        x = x - torch.tensor(p.presence_penalty, dtype=x.dtype) * (counts > 0).to(x.dtype)
    if p.is_greedy:
        return x
    if p.temperature != 1.0:
        x = TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.top_k != -1:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1.0:
        x = TopPLogitsWarper(p.top_p)(ids, x)
    if p.min_p > 0.0:
        x = MinPLogitsWarper(p.min_p)(ids, x)
    return x


@SETTINGS
@given(batch_st())
def test_processed_distribution_matches_transformers(batch):
    logits, rows = batch
    ours = apply_penalties_and_warpers(logits, rows)
    assert ours.shape == logits.shape and ours.dtype == logits.dtype
    for i, row in enumerate(rows):
        ref = reference_row(logits[i : i + 1], row)[0]
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref)), (i, row.params)
        torch.testing.assert_close(ours[i].softmax(-1), ref.softmax(-1), rtol=1e-5, atol=1e-6)


@SETTINGS
@given(batch_st())
def test_sampled_tokens_in_support_and_logprobs(batch):
    logits, rows = batch
    processed = apply_penalties_and_warpers(logits, rows)
    out = Sampler()(logits, rows)
    assert len(out.token_ids) == len(out.logprobs) == len(rows)
    logp = processed.log_softmax(-1)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert 0 <= tok < logits.shape[1]
        assert processed[i, tok] > -math.inf
        if rows[i].params.is_greedy:
            assert tok == int(processed[i].argmax())
        assert lp == pytest.approx(float(logp[i, tok]), abs=1e-5)
    want = [r.params.logprobs or 0 for r in rows]
    if max(want) == 0:
        assert out.top_logprobs is None
    else:
        assert out.top_logprobs is not None
        for i, k in enumerate(want):
            top = out.top_logprobs[i]
            finite = int(torch.isfinite(logp[i]).sum())
            assert len(top) == min(k, finite)
            ref_vals = logp[i].topk(len(top)).values.tolist() if top else []
            assert [v for _, v in top] == pytest.approx(ref_vals, abs=1e-6)
            assert all(logp[i, t] == pytest.approx(v, abs=1e-6) for t, v in top)


@SETTINGS
@given(batch_st())
def test_greedy_equals_argmax(batch):
    logits, rows = batch
    for r in rows:
        r.params = SamplingParams(
            temperature=0.0,
            repetition_penalty=r.params.repetition_penalty,
            presence_penalty=r.params.presence_penalty,
            frequency_penalty=r.params.frequency_penalty,
            min_tokens=r.params.min_tokens,
            logit_bias=r.params.logit_bias,
        )
    processed = apply_penalties_and_warpers(logits, rows)
    out = Sampler()(logits, rows)
    assert out.token_ids == processed.argmax(-1).tolist()


def test_fast_greedy_path():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1, 2], [3], frozenset({4})) for _ in range(6)]
    out = Sampler()(logits, rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    ref = logits.log_softmax(-1).max(-1).values
    assert out.logprobs == pytest.approx(ref.tolist(), abs=1e-6)
    assert out.top_logprobs is None
    rows[2].params = SamplingParams(temperature=0.0, logprobs=3)
    out = Sampler()(logits, rows)
    assert [t for t, _ in out.top_logprobs[2]] == logits[2].topk(3).indices.tolist()
    assert out.top_logprobs[0] == []
    # bf16 logits are accepted
    assert Sampler()(logits.bfloat16(), rows).token_ids == logits.bfloat16().float().argmax(-1).tolist()


def test_min_tokens_and_logit_bias():
    logits = torch.tensor([[0.0, 10.0, 0.0, 0.0]] * 3)
    p = SamplingParams(temperature=0.0, min_tokens=2)
    rows = [
        SamplingRow(p, [], [], frozenset({1})),  # EOS suppressed
        SamplingRow(p, [], [5, 6], frozenset({1})),  # min_tokens reached
        SamplingRow(SamplingParams(temperature=0.0, logit_bias={3: 100.0}), [], [], frozenset({1})),
    ]
    assert Sampler()(logits, rows).token_ids[0] != 1
    assert Sampler()(logits, rows).token_ids[1:] == [1, 3]


@SETTINGS
@given(batch_st(), st.integers(0, 2**31 - 1), st.integers(0, 4))
def test_seeded_rows_independent_of_batch(batch, seed, pos):
    logits, others = batch
    vocab = logits.shape[1]
    pos = min(pos, len(others))
    params = SamplingParams(temperature=0.9, top_k=max(2, vocab // 2), seed=seed)
    g = torch.Generator().manual_seed(1234)
    mine = torch.randn(1, vocab, generator=g, dtype=logits.dtype)

    def run(with_others: bool) -> list[int]:
        row = SamplingRow(params, [1], [], frozenset(), torch.Generator().manual_seed(seed))
        toks = []
        for _ in range(4):
            if with_others:
                rows = others[:pos] + [row] + others[pos:]
                batch_logits = torch.cat([logits[:pos], mine, logits[pos:]])
                toks.append(Sampler()(batch_logits, rows).token_ids[pos])
            else:
                toks.append(Sampler()(mine, [row]).token_ids[0])
        return toks

    assert run(False) == run(True)


def test_sampling_follows_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]]).repeat(4000, 1)
    params = SamplingParams(temperature=1.0, top_k=4)  # drops token 3
    rows = [SamplingRow(params, [], []) for _ in range(4000)]
    toks = torch.tensor(Sampler()(logits, rows).token_ids)
    freq = torch.bincount(toks, minlength=5).double() / 4000
    want = apply_penalties_and_warpers(logits[:1], rows[:1])[0].double().softmax(-1)
    assert freq[3] == 0
    assert torch.allclose(freq, want, atol=0.03), (freq, want)


def test_unseeded_rows_vary():
    logits = torch.zeros(64, 1000)
    rows = [SamplingRow(SamplingParams(), [], []) for _ in range(64)]
    assert len(set(Sampler()(logits, rows).token_ids)) > 32


def test_bad_shape():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), [SamplingRow(SamplingParams(temperature=0.0), [], [])])
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), [SamplingRow(SamplingParams(), [], [])])


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(64, 200),
    scale=st.sampled_from([3.0, 6.0, 10.0]),
    top_p=st.floats(0.05, 0.99),
    temperature=st.floats(0.3, 1.5),
    top_k=st.sampled_from([-1, -1, 5, 12]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_top_p_shortcuts_match_full_sort(monkeypatch_module, seed, vocab, scale, top_p, temperature, top_k, dtype):
    """The candidate-slice shortcuts (taken on peaked rows / after top_k) agree with transformers."""
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(seed), dtype=dtype) * scale
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    rows = [SamplingRow(params, [], []) for _ in range(3)]
    ours = apply_penalties_and_warpers(logits, rows)
    for i, row in enumerate(rows):
        ref = reference_row(logits[i : i + 1], row)[0]
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref))
        torch.testing.assert_close(ours[i].softmax(-1), ref.softmax(-1), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def monkeypatch_module():
    """Shrink the top_p candidate slice so small test vocabularies take the shortcut."""
    import runtime.sampler as sampler_mod

    mp = pytest.MonkeyPatch()
    mp.setattr(sampler_mod, "_TOP_P_CANDIDATES", 8)
    yield
    mp.undo()


def test_top_p_with_tied_logits_matches_transformers():
    # ties at the k-th value keep more than k tokens: the slice shortcut must fall back
    logits = torch.full((2, 64), -2.0)
    logits[:, :3] = 3.0
    logits[1, 3:6] = 2.0
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.7)
    rows = [SamplingRow(params, [], []) for _ in range(2)]
    ours = apply_penalties_and_warpers(logits, rows)
    for i, row in enumerate(rows):
        ref = reference_row(logits[i : i + 1], row)[0]
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref))
        torch.testing.assert_close(ours[i].softmax(-1), ref.softmax(-1))
