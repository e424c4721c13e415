"""Speculative decoding end to end on tiny float64 models: greedy output identical to plain decoding
for both proposers, at batch 1 and 8, with preemption and chunked prefill; every block of both
caches free afterwards; sampling, stops, logprobs, streaming, beam search alongside; bad
combinations raise specific errors."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from fxcompiler import LLM, SamplingParams
from fxcompiler.sampling_params import RequestOutputKind

REPEAT = [(5 * i + 7) % 240 + 3 for i in range(12)]
PROMPTS = [REPEAT * 3 + [17 + j] for j in range(3)] + [[(11 * i + j) % 250 + 3 for i in range(9 + 3 * j)]
                                                        for j in range(5)]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def make_llm(path, **kw):
    kw.setdefault("max_seq_len_to_capture", 256)
    kw.setdefault("paged_attention_block_size", 4)  # many block boundaries inside drafted runs
    kw.setdefault("devices", os.environ.get("FXCOMPILER_TEST_DEVICES"))
    return LLM(str(path), dtype="float64", cache_dir=None, **kw)


@pytest.fixture(scope="module")
def base(tiny_models):
    return make_llm(tiny_models["llama"])


@pytest.fixture(scope="module")
def reference(base):
    return [o.outputs[0].token_ids for o in base.generate(None, GREEDY, prompt_token_ids=PROMPTS)]


@pytest.fixture(scope="module")
def spec_llms(tiny_models):
    """The n-gram proposer, and a draft model: the target truncated to its first layer (it agrees
    often but not always, so runs are accepted and rejected)."""
    draft = make_llm(tiny_models["llama"], hf_overrides={"num_hidden_layers": 1}, skip_engine=True)
    return {"ngram": make_llm(tiny_models["llama"], speculative_model="[ngram]", num_speculative_tokens=3),
            "draft": make_llm(tiny_models["llama"], speculative_model=draft, num_speculative_tokens=3)}


def all_free(llm):
    for blocks in [llm.engine.scheduler.blocks] + (
            [llm.engine.speculator.proposer.blocks] if hasattr(llm.engine.speculator.proposer, "blocks") else []):
        blocks.check_invariants()
        assert blocks.num_free_blocks == blocks.num_usable_blocks


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_identical_batch_1_and_8(spec_llms, reference, proposer):
    llm = spec_llms[proposer]
    before = llm.engine.stats.spec_proposed_tokens
    one = llm.generate(None, GREEDY, prompt_token_ids=[PROMPTS[0]])[0].outputs[0].token_ids
    assert one == reference[0]
    outs = llm.generate(None, GREEDY, prompt_token_ids=PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == reference
    st = llm.engine.stats
    assert st.spec_proposed_tokens > before and st.spec_verify_steps > 0
    assert 0 < st.spec_accepted_tokens < st.spec_proposed_tokens  # both outcomes were exercised
    assert st.spec_mean_accepted_length > 1.0
    all_free(llm)


def test_stops_cut_an_accepted_run(spec_llms, reference):
    llm = spec_llms["ngram"]
    ref = reference[0]
    stop_at = next(i for i in range(4, len(ref)) if ref[i] not in ref[:i])
    sp = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ref[stop_at]])
    out = llm.generate(None, sp, prompt_token_ids=[PROMPTS[0]])[0].outputs[0]
    assert out.token_ids == ref[:stop_at + 1] and out.finish_reason == "stop"
    for n in (1, 2, 7, 13):
        out = llm.generate(None, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                           prompt_token_ids=[PROMPTS[1]])[0].outputs[0]
        assert out.token_ids == reference[1][:n] and out.finish_reason == "length"
    all_free(llm)


def test_logprobs_are_the_targets(spec_llms, base):
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    ref = base.generate(None, sp, prompt_token_ids=[PROMPTS[0]])[0].outputs[0]
    for llm in spec_llms.values():
        out = llm.generate(None, sp, prompt_token_ids=[PROMPTS[0]])[0].outputs[0]
        assert out.token_ids == ref.token_ids
        for a, b in zip(out.logprobs, ref.logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-9) and a[t].rank == b[t].rank
        assert out.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-8)


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampling_mixed_with_greedy_and_beam_search(spec_llms, base, reference, proposer):
    llm = spec_llms[proposer]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=25, ignore_eos=True,
                             repetition_penalty=1.1)
    beam = SamplingParams(use_beam_search=True, best_of=2, n=1, max_tokens=8, ignore_eos=True)
    params = [sampled, GREEDY, beam, sampled, GREEDY]
    outs = llm.generate(None, params, prompt_token_ids=PROMPTS[:5])
    for i in (1, 4):
        assert outs[i].outputs[0].token_ids == reference[i]
    for i in (0, 3):
        assert len(outs[i].outputs[0].token_ids) == 25 and all(0 <= t < 256 for t in outs[i].outputs[0].token_ids)
    ref_beam = base.generate(None, beam, prompt_token_ids=[PROMPTS[2]])[0].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == ref_beam
    all_free(llm)


def test_delta_stream_emits_accepted_runs(spec_llms, reference):
    llm = spec_llms["ngram"]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    steps = []
    llm.engine.add_request("delta", PROMPTS[0], sp)
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            steps.append(o.outputs[0].token_ids)
    assert [t for s in steps for t in s] == reference[0]
    assert max(len(s) for s in steps) > 1  # some step emitted a run of accepted drafts
    all_free(llm)


def test_preemption_and_chunked_prefill_keep_greedy_outputs(tiny_models, reference):
    llm = make_llm(tiny_models["llama"], speculative_model="[ngram]", num_speculative_tokens=3,
                   paged_attention_num_blocks=40, prefill_chunk_size=16)
    outs = llm.generate(None, GREEDY, prompt_token_ids=PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == reference
    st = llm.engine.stats
    assert st.preemptions > 0 and st.prefill_chunks > 0 and st.spec_accepted_tokens > 0
    all_free(llm)


def test_adaptive_k_backs_off(spec_llms):
    from runtime.speculative import LOW_ACCEPTANCE, SpeculativeConfig, SpeculativeDecoder, _Adapt

    dec = SpeculativeDecoder(None, SpeculativeConfig(4))
    seq = object.__new__(type("S", (), {}))
    dec._adapt[seq] = _Adapt(4)
    for _ in range(3):
        dec._learn(seq, 4, 0)
    a = dec._adapt[seq]
    assert a.pause > 0 and a.k == 1 and LOW_ACCEPTANCE > 0
    dec._learn(seq, 1, 1)
    assert dec._adapt[seq].k == 2


def test_bad_combinations(tiny_models, base, tmp_path):
    from tests.conftest import save_tiny_model

    path = tiny_models["llama"]
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive int"):
        make_llm(path, speculative_model="[ngram]", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive int"):
        make_llm(path, speculative_model="[ngram]", num_speculative_tokens=-2)
    with pytest.raises(ValueError, match="without speculative_model"):
        make_llm(path, num_speculative_tokens=3)
    with pytest.raises(ValueError, match="num_speculative_tokens is required"):
        make_llm(path, speculative_model="[ngram]")
    with pytest.raises(ValueError, match=r"\[ngram\]:MIN:MAX"):
        make_llm(path, speculative_model="[ngram]:x", num_speculative_tokens=2)
    other_vocab = save_tiny_model(tmp_path / "v", "llama", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm(path, speculative_model=str(other_vocab), num_speculative_tokens=2)
    short = make_llm(path, max_seq_len_to_capture=128, skip_engine=True)
    with pytest.raises(ValueError, match="context limit"):
        make_llm(path, speculative_model=short, num_speculative_tokens=2)
    short_pos = save_tiny_model(tmp_path / "s", "llama", max_position_embeddings=128)
    with pytest.raises(ValueError, match="context limit"):
        make_llm(path, speculative_model=str(short_pos), num_speculative_tokens=2)
    from fxcompiler.config import KvCacheSharingAcrossBeamsConfig

    with pytest.raises(ValueError, match="beam search"):
        make_llm(path, speculative_model="[ngram]", num_speculative_tokens=2,
                 kv_cache_sharing_across_beams_config=KvCacheSharingAcrossBeamsConfig(2, 16))
    with pytest.raises(TypeError, match="speculative_model"):
        make_llm(path, speculative_model=3, num_speculative_tokens=2)


class _Tok:
    def __init__(self, vocab):
        self.vocab = vocab

    def __len__(self):
        return len(self.vocab)

    def get_vocab(self):
        return dict(self.vocab)


def test_tokenizer_mismatch():
    from fxcompiler.speculative import check_compatible

    def llm(tok):
        return SimpleNamespace(model_config=SimpleNamespace(vocab_size=3), tokenizer=tok, max_seq_len_to_capture=64)

    check_compatible(llm(_Tok({"a": 0, "b": 1})), llm(_Tok({"a": 0, "b": 1})))
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_compatible(llm(_Tok({"a": 0, "b": 1})), llm(_Tok({"a": 1, "b": 0})))
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_compatible(llm(_Tok({"a": 0})), llm(None))
