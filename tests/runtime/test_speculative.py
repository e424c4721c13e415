"""The speculator's adaptive k and back-off, and the n-gram proposer's lookup (no model involved)."""
from __future__ import annotations

import pytest

from fxcompiler.sampling_params import SamplingParams
from runtime.proposers import NgramProposer
from runtime.sequence import Sequence
from runtime.speculative import LOW_ACCEPTANCE, MAX_BACKOFF_STEPS, SpeculativeConfig, SpeculativeDecoder


def _seq(max_tokens=100, prompt=(3, 4, 5)):
    return Sequence("r", 0, list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens), 0)


def test_k_grows_after_full_runs_and_shrinks_after_rejections():
    dec = SpeculativeDecoder(None, SpeculativeConfig(4))
    s = _seq()
    assert dec._budget(s, 1000) == 4
    dec._learn(s, 4, 1)  # one accepted: try two next time
    assert dec._budget(s, 1000) == 2
    dec._learn(s, 2, 2)
    assert dec._budget(s, 1000) == 3
    dec._learn(s, 3, 3)
    dec._learn(s, 4, 4)
    assert dec._budget(s, 1000) == 4  # never above num_speculative_tokens


def test_low_acceptance_pauses_with_doubling_back_off():
    dec = SpeculativeDecoder(None, SpeculativeConfig(4))
    s = _seq()
    dec._budget(s, 1000)
    pauses = []
    for _ in range(8):
        while dec._budget(s, 1000) == 0:  # the paused steps decode without drafts
            pauses[-1] += 1
        dec._learn(s, 1, 0)
        dec._learn(s, 1, 0)
        pauses.append(0)
    assert LOW_ACCEPTANCE > 0
    assert pauses[1:4] == [2, 4, 8] and max(pauses) == MAX_BACKOFF_STEPS
    for _ in range(6):  # acceptance recovers: the back-off resets
        while dec._budget(s, 1000) == 0:
            pass
        dec._learn(s, 1, 1)
    assert dec._adapt[s].backoff == 2


def test_not_adaptive_keeps_k_and_never_pauses():
    dec = SpeculativeDecoder(None, SpeculativeConfig(3, adaptive=False))
    s = _seq()
    dec._budget(s, 1000)
    for _ in range(10):
        dec._learn(s, 3, 0)
        assert dec._budget(s, 1000) == 3


def test_budget_respects_max_tokens_and_context():
    dec = SpeculativeDecoder(None, SpeculativeConfig(5))
    s = _seq(max_tokens=3)
    s.output_token_ids = [7]
    assert dec._budget(s, 1000) == 1  # one draft + the target's token reach max_tokens
    assert SpeculativeDecoder(None, SpeculativeConfig(5))._budget(_seq(), 5) == 2  # 3 tokens of a 5-token context


@pytest.mark.parametrize("k", [0, -1, True, 2.0])
def test_config_rejects_bad_k(k):
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive int"):
        SpeculativeConfig(k)


def test_ngram_lookup_prefers_longest_most_recent_match():
    p = NgramProposer(1, 3)
    assert p.find([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 3) == [8, 5, 1]  # the later "1 2 3"
    assert p.find([4, 5, 6, 7, 4, 5], 2) == [6, 7]
    assert p.find([1, 2, 3, 4], 2) == []  # no earlier occurrence of any suffix
    assert p.find([7, 7], 0) == []
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramProposer(3, 2)
