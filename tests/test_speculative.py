"""Speculative decoding end to end on tiny float64 models: greedy output identical to plain decoding
for the n-gram proposer and two drafts (a different random model with the same vocabulary, and the
target itself), at batch 1 and with 8 concurrent requests, with the block managers' invariants
checked every step and every block free afterwards; sampling, beam search and parallel samples in
the same batch; stops, logprobs, streaming, preemption and chunked prefill; acceptance statistics;
and every bad combination's error (raised before anything is compiled)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from fxcompiler import LLM, SamplingParams
from fxcompiler.sampling_params import RequestOutputKind
from tests.conftest import save_tiny_model, tiny_config

REPEAT = [(5 * i + 7) % 240 + 3 for i in range(12)]
# 8 prompts: three that repeat a phrase (n-gram lookup finds continuations), five that do not
PROMPTS = [REPEAT * 3 + [17 + j] for j in range(3)] + [[(11 * i + j) % 250 + 3 for i in range(9 + 3 * j)]
                                                        for j in range(5)]
NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
K = 3


def make_llm(path, cache_dir, **kw):
    kw.setdefault("max_seq_len_to_capture", 128)
    kw.setdefault("paged_attention_block_size", 4)  # many block boundaries inside drafted runs
    kw.setdefault("devices", os.environ.get("FXCOMPILER_TEST_DEVICES"))
    return LLM(str(path), dtype="float64", cache_dir=cache_dir, **kw)


@pytest.fixture(scope="module")
def base(tiny_models, cache_dir):
    return make_llm(tiny_models["llama"], cache_dir)


@pytest.fixture(scope="module")
def reference(base):
    return [o.outputs[0].token_ids for o in base.generate(None, GREEDY, prompt_token_ids=PROMPTS)]


@pytest.fixture(scope="module")
def spec_llms(tiny_models, base, cache_dir, tmp_path_factory):
    """The n-gram proposer; a draft that is a different random model (other weights, one layer,
    same vocabulary: it rarely agrees); the target itself as its own draft (it always agrees)."""
    other_path = save_tiny_model(tmp_path_factory.mktemp("draft") / "other", "llama", seed=1, num_hidden_layers=1)
    other = make_llm(other_path, cache_dir, skip_engine=True)
    path = tiny_models["llama"]
    return {"ngram": make_llm(path, cache_dir, speculative_model="[ngram]", num_speculative_tokens=K),
            "other": make_llm(path, cache_dir, speculative_model=other, num_speculative_tokens=K),
            "self": make_llm(path, cache_dir, speculative_model=base, num_speculative_tokens=K)}


def block_managers(llm):
    prop = llm.engine.speculator.proposer
    return [llm.engine.scheduler.blocks] + ([prop.blocks] if hasattr(prop, "blocks") else [])


def all_free(llm):
    for blocks in block_managers(llm):
        blocks.check_invariants()
        assert blocks.num_free_blocks == blocks.num_usable_blocks


def run_checked(llm, prompts, params):
    """Step the engine by hand, checking both block managers' invariants after every step."""
    eng = llm.engine
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    final = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.error is None
            if o.finished:
                final[o.request_id] = o
        for blocks in block_managers(llm):
            blocks.check_invariants()
    return [final[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("proposer", ["ngram", "other", "self"])
def test_greedy_identical_batch_1_and_8(spec_llms, reference, proposer):
    llm = spec_llms[proposer]
    st = llm.engine.stats
    before = (st.spec_proposed_tokens, st.spec_accepted_tokens)
    plain_steps = st.decode_steps - st.spec_verify_steps
    one = llm.generate(None, GREEDY, prompt_token_ids=[PROMPTS[0]])[0].outputs[0].token_ids
    assert one == reference[0]
    all_free(llm)
    if proposer == "other":  # low acceptance: k shrinks, and speculation pauses for some steps
        assert st.spec_proposed_tokens - before[0] < K * st.spec_verified_seqs
        assert st.decode_steps - st.spec_verify_steps > plain_steps
    outs = run_checked(llm, PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    proposed, accepted = st.spec_proposed_tokens - before[0], st.spec_accepted_tokens - before[1]
    assert proposed > 0 and st.spec_verify_steps > 0
    if proposer == "self":  # the target drafting for itself: every draft is the target's choice
        assert accepted == proposed
        assert st.spec_mean_accepted_length > 2.0
    elif proposer == "ngram":  # the repeated phrases are accepted, the rest rejected
        assert 0 < accepted < proposed
    else:  # a different random model: mostly rejected, yet the output is the target's
        assert accepted < proposed
    assert st.spec_acceptance_rate == st.spec_accepted_tokens / st.spec_proposed_tokens
    all_free(llm)


def test_stops_and_max_tokens_cut_an_accepted_run(spec_llms, reference):
    for name in ("ngram", "self"):
        llm = spec_llms[name]
        ref = reference[0]
        stop_at = next(i for i in range(4, len(ref)) if ref[i] not in ref[:i])
        sp = SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[ref[stop_at]])
        out = llm.generate(None, sp, prompt_token_ids=[PROMPTS[0]])[0].outputs[0]
        assert out.token_ids == ref[:stop_at + 1] and out.finish_reason == "stop"
        for n in (1, 2, 7, 13):
            out = llm.generate(None, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                               prompt_token_ids=[PROMPTS[1]])[0].outputs[0]
            assert out.token_ids == reference[1][:n] and out.finish_reason == "length"
        all_free(llm)


def test_logprobs_are_the_targets(spec_llms, base):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = base.generate(None, sp, prompt_token_ids=[PROMPTS[0]])[0].outputs[0]
    for llm in spec_llms.values():
        out = llm.generate(None, sp, prompt_token_ids=[PROMPTS[0]])[0].outputs[0]
        assert out.token_ids == ref.token_ids
        for a, b in zip(out.logprobs, ref.logprobs):
            assert a.keys() == b.keys()
            for t in a:
                assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-9) and a[t].rank == b[t].rank
        assert out.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-8)


@pytest.mark.parametrize("proposer", ["ngram", "self"])
def test_sampling_beam_search_and_parallel_samples_in_one_batch(spec_llms, base, reference, proposer):
    """Beam search and n > 1 run without speculation in the same continuous batch as speculated
    greedy and sampled requests (this mix used to hang: beams were sampled as ordinary rows)."""
    llm = spec_llms[proposer]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=16, ignore_eos=True,
                             repetition_penalty=1.1)
    beam = SamplingParams(use_beam_search=True, best_of=2, n=1, max_tokens=8, ignore_eos=True)
    pair = SamplingParams(temperature=0.7, n=2, max_tokens=10, ignore_eos=True)
    params = [sampled, GREEDY, beam, pair, GREEDY]
    verify_before = llm.engine.stats.spec_verify_steps
    outs = run_checked(llm, PROMPTS[:5], params)
    assert llm.engine.stats.spec_verify_steps > verify_before
    for i in (1, 4):
        assert outs[i].outputs[0].token_ids == reference[i]
    assert len(outs[0].outputs[0].token_ids) == 16 and all(0 <= t < 256 for t in outs[0].outputs[0].token_ids)
    ref_beam = base.generate(None, beam, prompt_token_ids=[PROMPTS[2]])[0].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == ref_beam
    assert [len(c.token_ids) for c in outs[3].outputs] == [10, 10]
    all_free(llm)


def test_delta_stream_emits_accepted_runs(spec_llms, reference):
    llm = spec_llms["self"]
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    steps = []
    llm.engine.add_request("delta", PROMPTS[3], sp)
    while llm.engine.has_unfinished_requests():
        for o in llm.engine.step():
            steps.append(o.outputs[0].token_ids)
    assert [t for s in steps for t in s] == reference[3]
    assert max(len(s) for s in steps) == K + 1  # a step emitted k accepted drafts and the bonus token
    all_free(llm)


def test_preemption_and_chunked_prefill_keep_greedy_outputs(tiny_models, base, reference, cache_dir):
    for draft in ("[ngram]", base):
        llm = make_llm(tiny_models["llama"], cache_dir, speculative_model=draft, num_speculative_tokens=K,
                       paged_attention_num_blocks=48, prefill_chunk_size=16)
        outs = run_checked(llm, PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference
        st = llm.engine.stats
        assert st.preemptions > 0 and st.prefill_chunks > 0 and st.spec_accepted_tokens > 0
        all_free(llm)
        llm.shutdown()


def test_num_speculative_tokens_falls_back_to_n_predict():
    from fxcompiler.speculative import _n_predict

    assert _n_predict(SimpleNamespace(n_predict=None), SimpleNamespace(n_predict=5)) == 5
    assert _n_predict(SimpleNamespace(n_predict=2), SimpleNamespace(n_predict=5)) == 2
    assert _n_predict(SimpleNamespace()) is None


def _tokenizer_dir(path, vocab: dict[str, int]):
    """A config-only model directory with a word-level tokenizer (nothing there is ever compiled)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tiny_config("llama").save_pretrained(path)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)
    return path


def test_bad_combinations(tiny_models, base, cache_dir, tmp_path):
    from fxcompiler.config import KvCacheSharingAcrossBeamsConfig

    path = tiny_models["llama"]

    def bad(exc, match, model=path, **kw):
        with pytest.raises(exc, match=match):
            make_llm(model, cache_dir, **kw)

    for k in (0, -2, 1.5, True):
        bad(ValueError, "num_speculative_tokens must be a positive int", speculative_model="[ngram]",
            num_speculative_tokens=k)
    bad(ValueError, "without speculative_model", num_speculative_tokens=3)
    bad(ValueError, "without speculative_model", speculative_draft_tensor_parallel_size=1)
    bad(ValueError, r"\[ngram\]:MIN:MAX", speculative_model="[ngram]:x", num_speculative_tokens=2)
    bad(ValueError, "1 <= MIN <= MAX", speculative_model="[ngram]:3:2", num_speculative_tokens=2)
    bad(TypeError, "speculative_model", speculative_model=3, num_speculative_tokens=2)
    # a draft whose vocabulary differs
    bad(ValueError, r"vocabulary \(300 tokens\) differs from the target's \(256\)",
        speculative_model=str(save_tiny_model(tmp_path / "v", "llama", vocab_size=300)), num_speculative_tokens=2)
    # a draft whose tokenizer differs (same vocabulary size, other token ids)
    words = [f"w{i}" for i in range(255)]
    tgt = _tokenizer_dir(tmp_path / "tok_a", {"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}})
    drf = _tokenizer_dir(tmp_path / "tok_b", {"<unk>": 0, **{w: 255 - i for i, w in enumerate(words)}})
    bad(ValueError, "tokenizer differs", model=tgt, speculative_model=str(drf), num_speculative_tokens=2)
    bad(ValueError, "tokenizer differs", model=path, speculative_model=str(drf), num_speculative_tokens=2)
    # a draft whose context limit is shorter than the target's
    bad(ValueError, "context limit", max_seq_len_to_capture=256, speculative_model=base, num_speculative_tokens=2)
    bad(ValueError, "context limit", max_seq_len_to_capture=256, num_speculative_tokens=2,
        speculative_model=str(save_tiny_model(tmp_path / "s", "llama", max_position_embeddings=192)))
    # speculative decoding with the beam-search-only engine
    bad(ValueError, "beam search", speculative_model="[ngram]", num_speculative_tokens=2,
        kv_cache_sharing_across_beams_config=KvCacheSharingAcrossBeamsConfig(2, 16))
    # no k anywhere: refused before the target or the draft is compiled
    bad(ValueError, "num_speculative_tokens is required", speculative_model="[ngram]")
    import fxcompiler.speculative as speculative

    def no_build(*_a, **_k):
        raise AssertionError("the draft was built before its arguments were checked")

    real_build = speculative.build_draft
    speculative.build_draft = no_build
    try:
        bad(ValueError, "num_speculative_tokens is required: neither the draft's", speculative_model=path)
    finally:
        speculative.build_draft = real_build
    # a KV8 draft (its KV cache is float): by config and by qformat, refused before anything is built
    from fxcompiler import LLMConfig, QuantizationConfig

    bad(NotImplementedError, r"int8 KV cache \(KV8\) for the draft", speculative_model=path, num_speculative_tokens=2,
        speculative_model_llm_config=LLMConfig(quantization_config=QuantizationConfig.from_str("W8A32KV8")))
    qformat = tmp_path / "kv8.yaml"
    qformat.write_text("--weight_dtype int8 --act_dtype fp32 --kv_dtype int8\nmodules:\n  \"*\": {weight: int8}\n")
    bad(NotImplementedError, r"int8 KV cache \(KV8\) for the draft", speculative_model=path, num_speculative_tokens=2,
        speculative_model_qformat_path=qformat)


class _Tok:
    def __init__(self, vocab):
        self.vocab = vocab

    def __len__(self):
        return len(self.vocab)

    def get_vocab(self):
        return dict(self.vocab)


def test_tokenizer_mismatch_rules():
    from fxcompiler.speculative import check_compatible

    def llm(tok, ctx=64):
        return SimpleNamespace(model_config=SimpleNamespace(vocab_size=3), tokenizer=tok, max_seq_len_to_capture=ctx)

    check_compatible(llm(_Tok({"a": 0, "b": 1})), llm(_Tok({"a": 0, "b": 1}), ctx=128))
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_compatible(llm(_Tok({"a": 0, "b": 1})), llm(_Tok({"a": 1, "b": 0})))
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_compatible(llm(_Tok({"a": 0})), llm(None))
    with pytest.raises(ValueError, match="context limit"):
        check_compatible(llm(None, ctx=128), llm(None, ctx=64))


def test_quantized_copy_of_the_target_drafts_losslessly(tiny_models, reference, cache_dir):
    """The draft a user of this machine has: the target's own checkpoint quantized (int8 weights,
    through ``speculative_model_llm_config``). Its guesses differ from the float64 target's at
    times; the output must not."""
    from fxcompiler import LLMConfig, QuantizationConfig

    path = tiny_models["llama"]
    llm = make_llm(path, cache_dir, speculative_model=str(path), num_speculative_tokens=K,
                   speculative_model_llm_config=LLMConfig(quantization_config=QuantizationConfig.from_str("W8A32")))
    try:
        draft = llm.speculative_llm
        assert draft.quantization is not None and draft.quantization != {}
        assert any(h.get("pass") == "quantize" and h.get("modified") for h in draft.pass_history), draft.pass_history
        outs = run_checked(llm, PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert llm.engine.stats.spec_proposed_tokens > 0 and llm.engine.stats.spec_accepted_tokens > 0
        all_free(llm)
    finally:
        llm.shutdown()
