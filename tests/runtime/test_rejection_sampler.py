"""The speculative rejection sampler: emitted tokens follow the target distribution (chi-square over
1e5 vectorised draws), with the sampler's own top-k/top-p/min-p filters applied to both sides."""
from __future__ import annotations

import zlib

import pytest
import torch

from fxcompiler.sampling_params import SamplingParams
from runtime.rejection_sampler import greedy_verify, rejection_sample
from runtime.sampler import SamplingRow, apply_penalties_and_warpers

N = 100_000
V = 12
K = 3


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed ``counts`` against expected ``probs`` (zero-probability cells must be empty)."""
    assert counts[probs == 0].sum() == 0, "a token the target filtered out was emitted"
    keep = probs > 0
    n = counts.sum()
    expected = probs[keep].double() * n
    stat = ((counts[keep].double() - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def filtered(logits: torch.Tensor, **sp) -> torch.Tensor:
    """The sampler's processed distribution for one request's parameters."""
    rows = [SamplingRow(SamplingParams(**sp), [1], [])] * logits.shape[0]
    return apply_penalties_and_warpers(logits.double(), rows).softmax(dim=-1)


CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, top_k=8, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("sp", CASES)
@pytest.mark.parametrize("proposer", ["draft", "point_mass"])
def test_emitted_tokens_follow_the_target(sp, proposer):
    g = torch.Generator().manual_seed(zlib.crc32(repr((proposer, sorted(sp.items()))).encode()))  # fixed seeds
    logits = torch.randn(K + 1, V, generator=g) * 1.5
    p = filtered(logits, **sp)  # target, one row per position
    if proposer == "draft":  # a different draft near the target (their filtered supports overlap), same filters
        q = filtered(logits[:K] + torch.randn(K, V, generator=g), **sp)
        drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(K)], 1)
        qb = q[None].expand(N, K, V)
    else:  # n-gram: deterministic guesses, one of them outside the filtered set when there is one
        guess = torch.tensor([int(p[0].argmax()), int(p[1].argmin()), int(p[2].argsort()[-2])])
        drafts, qb = guess[None].expand(N, K).contiguous(), None
    num = torch.randint(0, K + 1, (N,), generator=g)  # rows with 0..K drafts
    u = torch.rand(N, K + 1, generator=g, dtype=torch.float64)
    n_acc, final = rejection_sample(p[None].expand(N, K + 1, V), drafts, num, qb, u[:, :K], u[:, K])
    assert bool((n_acc <= num).all())
    first = torch.where(n_acc > 0, drafts[:, 0], final)
    assert chi_square_p(torch.bincount(first, minlength=V), p[0]) > 1e-3
    # the second emitted token (rows that accepted d_1 and had a second position) follows p_1
    has2 = (n_acc >= 1)
    second = torch.where(n_acc[has2] > 1, drafts[has2, 1], final[has2])
    assert has2.sum() > 10_000
    assert chi_square_p(torch.bincount(second, minlength=V), p[1]) > 1e-3


def test_a_wrong_sampler_fails_the_test():
    """The test can fail: accepting every draft emits the draft's distribution, not the target's."""
    g = torch.Generator().manual_seed(7)
    p = filtered(torch.randn(2, V, generator=g) * 1.5, temperature=1.0)
    q = filtered(torch.randn(1, V, generator=g) * 1.5, temperature=1.0)
    d = torch.multinomial(q[0], N, replacement=True, generator=g)
    assert chi_square_p(torch.bincount(d, minlength=V), p[0]) < 1e-3


def test_identical_draft_is_always_accepted():
    g = torch.Generator().manual_seed(3)
    p = filtered(torch.randn(K + 1, V, generator=g), temperature=1.0)
    d = torch.stack([torch.multinomial(p[j], 1000, replacement=True, generator=g) for j in range(K)], 1)
    u = torch.rand(1000, K + 1, generator=g, dtype=torch.float64)
    n_acc, _ = rejection_sample(p[None].expand(1000, K + 1, V), d, torch.full((1000,), K),
                                p[None, :K].expand(1000, K, V), u[:, :K], u[:, K])
    assert bool((n_acc == K).all())


def test_greedy_verify():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [4, 6, 7], [1, 2, 0]])
    n_acc, final = greedy_verify(target, drafts, torch.tensor([3, 3, 3, 2]))
    assert n_acc.tolist() == [3, 1, 0, 2]
    assert final.tolist() == [8, 6, 5, 3]
