"""The int8 KV cache inside the engine: prefix caching, preemption, parallel samples (n > 1) and n-gram
speculation give the tokens a plain KV8 run gives, with the same static scales, and return every block."""
from __future__ import annotations

import pytest
import torch

from fxcompiler import LLM, SamplingParams

PREFIX = [(7 * i + 3) % 250 + 3 for i in range(45)]
PROMPTS = [PREFIX[:30], PREFIX[:30] + [7, 7, 9], PREFIX + [11, 12], PREFIX[:13], [5, 6, 7, 5, 6, 7, 5, 6]]
SP = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _llm(path, **kw) -> LLM:
    kw.setdefault("enable_prefix_caching", False)
    return LLM(str(path), dtype="float32", cache_dir=None, kv_cache_dtype="int8", max_seq_len_to_capture=128,
               paged_attention_block_size=4, **kw)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _all_blocks_free(llm: LLM) -> None:
    blocks = llm.engine.scheduler.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_usable_blocks


@pytest.fixture(scope="module")
def reference(tiny_models):
    llm = _llm(tiny_models["llama"])
    assert llm.engine.runner.kv.k[0].dtype == torch.int8
    outs = _tokens(llm.generate(None, SP, prompt_token_ids=PROMPTS))
    yield llm.kv_cache_scales, outs
    llm.shutdown()


def test_prefix_cache_hits_give_the_same_tokens(tiny_models, reference):
    scales, ref = reference
    llm = _llm(tiny_models["llama"], kv_cache_scales=scales, enable_prefix_caching=True)
    try:
        first = _tokens(llm.generate(None, SP, prompt_token_ids=PROMPTS))
        again = _tokens(llm.generate(None, SP, prompt_token_ids=PROMPTS))
        assert llm.engine.stats.prefix_cache_hits > 0
        assert first == ref and again == ref
        _all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_preempted_requests_recompute_the_same_tokens(tiny_models, reference):
    scales, ref = reference
    llm = _llm(tiny_models["llama"], kv_cache_scales=scales, paged_attention_num_blocks=24)
    try:
        assert _tokens(llm.generate(None, SP, prompt_token_ids=PROMPTS)) == ref
        assert llm.engine.stats.preemptions > 0
        _all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_ngram_speculation_matches_plain_decoding(tiny_models, reference):
    scales, ref = reference
    llm = _llm(tiny_models["llama"], kv_cache_scales=scales, speculative_model="[ngram]", num_speculative_tokens=3)
    try:
        assert _tokens(llm.generate(None, SP, prompt_token_ids=PROMPTS)) == ref
        st = llm.engine.stats
        assert st.spec_accepted_tokens > 0 and st.spec_proposed_tokens > st.spec_accepted_tokens  # both paths ran
        _all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_parallel_samples_sharing_prompt_blocks_equal_their_own_requests(tiny_models, reference):
    """n = 3 samples fork one prompt's int8 blocks (and its scales); sample k draws from the seed
    ``seed + k * 0x9E3779B97F4A7C15`` (runtime.admission.child_generator), so each must equal a request of
    its own with that seed, whose blocks nobody shares."""
    scales, _ = reference
    seed, golden = 1234, 0x9E3779B97F4A7C15
    llm = _llm(tiny_models["llama"], kv_cache_scales=scales, enable_prefix_caching=True)
    try:
        sp = dict(temperature=0.9, top_p=0.95, max_tokens=16, ignore_eos=True)
        forks = llm.generate(None, SamplingParams(n=3, seed=seed, **sp), prompt_token_ids=PROMPTS[:3])
        for prompt, out in zip(PROMPTS[:3], forks):
            alone = [llm.generate(None, SamplingParams(seed=(seed + k * golden) % (1 << 64), **sp),
                                  prompt_token_ids=[prompt])[0].outputs[0].token_ids for k in range(3)]
            assert [c.token_ids for c in out.outputs] == alone
            assert len({tuple(t) for t in alone}) > 1  # the samples differ: the forks really diverged
        _all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_artifact_round_trip_keeps_the_int8_cache_and_its_scales(tiny_models, reference, tmp_path):
    scales, ref = reference
    path = tmp_path / "kv8-artifact"
    built = _llm(tiny_models["llama"], kv_cache_scales=scales, artifacts_export_path=path)
    built.shutdown()
    loaded = LLM.load_artifact(path, cache_dir=None)
    try:
        assert loaded.engine.runner.kv.k[0].dtype == torch.int8
        assert all(torch.equal(a, b) for a, b in zip(loaded.kv_cache_scales, scales))
        assert _tokens(loaded.generate(None, SP, prompt_token_ids=PROMPTS)) == ref
        _all_blocks_free(loaded)
    finally:
        loaded.shutdown()


def test_a_kv8_quantization_config_turns_on_the_int8_cache(tiny_models, reference, tmp_path):
    """furiosa's KV8 schemes (``W8A16KV8``, ``w_i8_a_i8_kv_i8``, a qformat's ``--kv_dtype int8``) run the int8 cache
    with the weight scheme: the same tokens as the weight scheme with ``kv_cache_dtype="int8"`` and the same scales."""
    from fxcompiler import LLMConfig, QuantizationConfig

    scales, _ = reference
    path = tiny_models["llama"]
    ref = _llm(path, kv_cache_scales=scales, llm_config=LLMConfig(quantization_config=QuantizationConfig.from_str("W8A32")))
    try:
        want = _tokens(ref.generate(None, SP, prompt_token_ids=PROMPTS))
    finally:
        ref.shutdown()
    qformat = tmp_path / "qformat.yaml"
    qformat.write_text("--weight_dtype int8 --act_dtype fp32 --kv_dtype int8\nmodules:\n  \"*\": {weight: int8}\n")
    for kw in (dict(llm_config=LLMConfig(quantization_config=QuantizationConfig.from_str("W8A32KV8"))),
               dict(qformat_path=qformat)):
        llm = LLM(str(path), dtype="float32", cache_dir=None, max_seq_len_to_capture=128, paged_attention_block_size=4,
                  enable_prefix_caching=False, kv_cache_scales=scales, **kw)
        try:
            assert llm.kv_cache_dtype == "int8" and llm.engine.runner.kv.k[0].dtype == torch.int8
            assert llm.quantization is not None
            assert _tokens(llm.generate(None, SP, prompt_token_ids=PROMPTS)) == want
            _all_blocks_free(llm)
        finally:
            llm.shutdown()
    w8a8 = LLM(str(path), dtype="float32", cache_dir=None, max_seq_len_to_capture=128, paged_attention_block_size=4,
               kv_cache_scales=scales, llm_config=LLMConfig(quantization_config=QuantizationConfig.w_i8_a_i8_kv_i8()))
    try:
        assert w8a8.kv_cache_dtype == "int8" and w8a8.engine.runner.kv.k[0].dtype == torch.int8
        assert len(w8a8.generate(None, SP, prompt_token_ids=PROMPTS[:2])[0].outputs[0].token_ids) == 20
    finally:
        w8a8.shutdown()


def test_a_float_kv_quantization_config_conflicts_with_an_int8_cache(tiny_models):
    from fxcompiler import LLMConfig, QuantizationConfig

    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' conflicts with llm_config.quantization_config=W8A16KV16"):
        LLM(str(tiny_models["llama"]), kv_cache_dtype="int8",
            llm_config=LLMConfig(quantization_config=QuantizationConfig.from_str("W8A16KV16")))


def check_beams_share_quantized_blocks(llm: LLM) -> None:
    """Beam search over an int8 / fp8 cache with ``kv_cache_sharing_across_beams_config``: the beams share their
    prompt's blocks (copy-on-write copies the codes of a shared last block as bytes; the static scales live in the
    scale block, which no copy touches), and give the same beams as a run whose forks copy every block at once
    (no block shared by two beams), on the same engine and buckets; every block returns and the scales stay."""
    from .test_decoding import beam_params

    prompts = [PREFIX[:21], PREFIX[10:30], PREFIX[20:45]]
    params = beam_params(4, 1.0, False, None, max_tokens=12)
    blocks, kv = llm.engine.scheduler.blocks, llm.engine.runner.kv
    scale_block = [t[kv.num_blocks].view(torch.uint8).clone() for t in kv.k + kv.v]  # bytes: fp32 in e4m3 has NaNs
    shared_refs = []
    fork = blocks.fork

    def watching_fork(parent, child):
        fork(parent, child)
        shared_refs.append(int(blocks.ref_counts[blocks.block_tables[child.slot, 0]]))

    blocks.fork = watching_fork
    try:
        cows = llm.engine.stats.copies_on_write
        shared = [[c.token_ids for c in o.outputs] for o in llm.generate(None, params, prompt_token_ids=prompts)]
        assert shared_refs and max(shared_refs) >= 4  # a prompt block read by all four beams
        assert llm.engine.stats.copies_on_write > cows  # the codes of shared last blocks were copied
    finally:
        del blocks.fork
    _all_blocks_free(llm)

    def private_fork(parent, child):  # the child gets its own copy of every block: nothing shared
        fork(parent, child)
        for i in range(int(blocks.num_seq_blocks[child.slot])):
            old, new = int(blocks.block_tables[child.slot, i]), blocks._take()
            blocks.pending_copies.append((old, new))
            blocks._release(old)
            blocks.block_tables[child.slot, i] = new
        assert not set(blocks.block_tables[child.slot, :int(blocks.num_seq_blocks[child.slot])]) & set(
            blocks.block_tables[parent.slot, :int(blocks.num_seq_blocks[parent.slot])])

    blocks.fork = private_fork
    try:
        private = [[c.token_ids for c in o.outputs] for o in llm.generate(None, params, prompt_token_ids=prompts)]
    finally:
        del blocks.fork
    assert private == shared
    assert all(len(beams) == 4 for beams in shared) and any(len({tuple(b) for b in beams}) > 1 for beams in shared)
    _all_blocks_free(llm)
    assert all(torch.equal(t[kv.num_blocks].view(torch.uint8), s) for t, s in zip(kv.k + kv.v, scale_block))


def test_beams_share_int8_blocks(tiny_models, reference):
    from fxcompiler.config import KvCacheSharingAcrossBeamsConfig

    scales, _ = reference
    llm = _llm(tiny_models["llama"], kv_cache_scales=scales,
               kv_cache_sharing_across_beams_config=KvCacheSharingAcrossBeamsConfig(4, 12))
    try:
        assert llm.engine.runner.kv.k[0].dtype == torch.int8
        check_beams_share_quantized_blocks(llm)
    finally:
        llm.shutdown()
