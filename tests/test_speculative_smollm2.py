"""Speculative decoding on the embedded SmolLM2-135M-Instruct (fp32, real weights): greedy output
equals plain decoding (a divergence is allowed only at a near-tie of the plain run's top-2
logprobs) for the n-gram proposer and for the model drafting for itself, at batch 1 and batched.
One speculative LLM serves both proposers (its engine's speculator is switched)."""
from __future__ import annotations

import pytest

from fxcompiler import LLM, SamplingParams
from fxcompiler.models.sources import DEFAULT_MODEL_ID

pytestmark = pytest.mark.slow

PROMPTS = ["Repeat exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
           "def fibonacci(n):",
           "The capital of France is"]
NEW_TOKENS = 32
TIE = 1e-4  # the suite's near-tie rule (tests/test_smollm2.py)


@pytest.fixture(scope="module")
def plain():
    return LLM(DEFAULT_MODEL_ID, max_seq_len_to_capture=256)


@pytest.fixture(scope="module")
def reference(plain):
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    return plain.generate(PROMPTS, sp)


@pytest.fixture(scope="module")
def spec(plain):
    from runtime.proposers import NgramProposer
    from runtime.speculative import SpeculativeConfig, SpeculativeDecoder

    llm = LLM(DEFAULT_MODEL_ID, max_seq_len_to_capture=256, speculative_model=plain, num_speculative_tokens=4)
    return llm, {"self": llm.engine.speculator,
                 "ngram": SpeculativeDecoder(NgramProposer(2, 4), SpeculativeConfig(4))}


def _check(ref, ours: list[int]) -> None:
    want = ref.outputs[0]
    assert len(ours) == len(want.token_ids)
    for step, (a, b) in enumerate(zip(ours, want.token_ids)):
        if a != b:
            top2 = sorted((lp.logprob for lp in want.logprobs[step].values()), reverse=True)[:2]
            gap = top2[0] - top2[1]
            assert gap < TIE, f"diverged at step {step} ({a} vs {b}) where the plain run's top-2 gap is {gap}"
            return


@pytest.mark.parametrize("proposer", ["ngram", "self"])
def test_greedy_equals_plain_decoding(spec, reference, proposer):
    spec, speculators = spec
    eng = spec.engine
    eng.speculator = speculators[proposer]
    accepted = eng.stats.spec_accepted_tokens
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    _check(reference[0], spec.generate(PROMPTS[0], sp).outputs[0].token_ids)  # batch 1
    for ref, out in zip(reference[1:], spec.generate(PROMPTS[1:], sp)):  # batched
        _check(ref, out.outputs[0].token_ids)
    assert eng.stats.spec_accepted_tokens > accepted and eng.stats.spec_mean_accepted_length > 1.0
    blocks = eng.scheduler.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_usable_blocks
