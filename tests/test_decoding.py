"""End-to-end decoding features against transformers on fp64 tiny models: prefix reuse,
parallel sampling (n / best_of), prompt logprobs, chunked prefill, beam search."""
from __future__ import annotations

import os
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from fxcompiler import LLM, SamplingParams
from fxcompiler.pipeline import Bucket

PREFIX = [(7 * i + 3) % 250 + 3 for i in range(45)]
SUFFIXES = [[11, 12, 13], [200, 201], list(range(30, 50)), [99], []]


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def hf_llama(tiny_models):
    return AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float64)


def make_llm(path, **kw):
    kw.setdefault("max_seq_len_to_capture", 256)
    kw.setdefault("devices", os.environ.get("FXCOMPILER_TEST_DEVICES"))  # e.g. "cuda" on a GPU machine
    return LLM(str(path), dtype="float64", cache_dir=None, **kw)


@pytest.mark.parametrize("arch,block_size", [("llama", 16), ("llama", 4), ("mistral", 8), ("gpt2", 4)])
def test_prefix_reuse_greedy_identical(tiny_models, hf_llama, arch, block_size):
    llm = make_llm(tiny_models[arch], paged_attention_block_size=block_size)
    if arch != "llama":
        hf_llama = AutoModelForCausalLM.from_pretrained(str(tiny_models[arch]), dtype=torch.float64)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate(None, sp, prompt_token_ids=[PREFIX])[0]
    assert first.outputs[0].token_ids == hf_greedy(hf_llama, PREFIX, 12)
    stats = llm.engine.stats
    assert stats.prefix_cache_hits == 0
    prompts = [PREFIX + s for s in SUFFIXES]
    outs = llm.generate(None, sp, prompt_token_ids=prompts)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_llama, p, 12)
    full_blocks = len(PREFIX) // block_size
    assert stats.prefix_cache_hits >= len(SUFFIXES) * full_blocks * block_size - block_size
    # a prompt that continues a finished request's output reuses the generated tokens' blocks too
    cont = PREFIX + first.outputs[0].token_ids + [5, 6]
    hits = stats.prefix_cache_hits
    out = llm.generate(None, sp, prompt_token_ids=[cont])[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_llama, cont, 12)
    assert stats.prefix_cache_hits - hits >= (len(cont) - 1) // block_size * block_size - block_size
    blocks = llm.engine.scheduler.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_usable_blocks  # cached blocks are all reclaimable


def test_prefix_caching_off(tiny_models, hf_llama):
    llm = make_llm(tiny_models["llama"], enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for _ in range(2):
        out = llm.generate(None, sp, prompt_token_ids=[PREFIX + [1, 2]])[0]
        assert out.outputs[0].token_ids == hf_greedy(hf_llama, PREFIX + [1, 2], 8)
    assert llm.engine.stats.prefix_cache_hits == 0 and llm.engine.scheduler.blocks.num_cached_blocks == 0


def hf_logprobs(model, prompt, completion, temperature=1.0):
    """log-softmax(logits / T) of each completion token given everything before it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0]
    lp = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)
    return lp.gather(1, torch.tensor(completion)[:, None]).squeeze(1)


@pytest.fixture(scope="module")
def llama_llm(tiny_models):
    return make_llm(tiny_models["llama"], paged_attention_block_size=4)


def test_parallel_sampling_shares_prompt_blocks(llama_llm, hf_llama):
    llm = llama_llm
    prompt = PREFIX[:22]  # 5 full blocks of 4 and a partial one: the children copy it on write
    stats = llm.engine.stats
    cow = stats.copies_on_write
    out = llm.generate(None, SamplingParams(n=3, temperature=0.8, max_tokens=10, ignore_eos=True, logprobs=0),
                       prompt_token_ids=[prompt])[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.token_ids) == 10 and c.finish_reason == "length"
        ref = hf_logprobs(hf_llama, prompt, c.token_ids, 0.8)
        ours = torch.tensor([next(iter(e.values())).logprob for e in c.logprobs], dtype=torch.float64)
        assert all(next(iter(e.values())).rank >= 1 for e in c.logprobs)
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-9)
        assert c.cumulative_logprob == pytest.approx(float(ref.sum()), abs=1e-8)
    assert stats.copies_on_write - cow == 2  # the prompt was computed once; its last block was copied twice
    blocks = llm.engine.scheduler.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_usable_blocks


def test_best_of_returns_the_best_n(llama_llm):
    llm = llama_llm
    sp = SamplingParams(n=2, best_of=5, temperature=1.0, max_tokens=6, ignore_eos=True, seed=123)
    out = llm.generate(None, sp, prompt_token_ids=[PREFIX[:9]])[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    # the same seed gives the same completions, alone or among other requests
    again = llm.generate(None, [sp, SamplingParams(n=3, temperature=1.0, max_tokens=6)],
                         prompt_token_ids=[PREFIX[:9], PREFIX[:30]])[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert llm.engine.stats.copies_on_write > 0


def test_prompt_logprobs_and_logprobs_match_transformers(llama_llm, hf_llama):
    prompt = PREFIX[:13]
    out = llama_llm.generate(None, SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2,
                                                  ignore_eos=True), prompt_token_ids=[prompt])[0]
    with torch.no_grad():
        lp = torch.log_softmax(hf_llama(torch.tensor([prompt])).logits[0], dim=-1)
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        entry, row = plp[i], lp[i - 1]
        tok = prompt[i]
        assert entry[tok].logprob == pytest.approx(float(row[tok]), abs=1e-9)
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = torch.topk(row, 2)
        for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert entry[t].logprob == pytest.approx(v, abs=1e-9) and entry[t].rank == r
        assert len(entry) in (2, 3)
    comp = out.outputs[0]
    assert comp.token_ids == hf_greedy(hf_llama, prompt, 4)
    for step, entry in enumerate(comp.logprobs):
        tok = comp.token_ids[step]
        assert entry[tok].rank == 1 and len(entry) == 3  # greedy: the sampled token is the top one
        with torch.no_grad():
            row = torch.log_softmax(hf_llama(torch.tensor([prompt + comp.token_ids[:step]])).logits[0, -1], -1)
        top = torch.topk(row, 3)
        for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert entry[t].logprob == pytest.approx(v, abs=1e-9) and entry[t].rank == r


def test_max_tokens_none_fills_the_context(tiny_models):
    llm = make_llm(tiny_models["qwen2"], max_seq_len_to_capture=48)
    out = llm.generate(None, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       prompt_token_ids=[PREFIX[:10]])[0]
    assert len(out.outputs[0].token_ids) == 38 and out.outputs[0].finish_reason == "length"


def test_chunk_size_arguments():
    import warnings

    from fxcompiler.config import (
        Bucket,
        SchedulerConfig,
        chunk_buckets,
        resolve_prefill_chunk_size,
    )

    assert resolve_prefill_chunk_size(None, None, None, None) is None
    assert resolve_prefill_chunk_size(64, None, None, None) == 64
    assert resolve_prefill_chunk_size(None, None, True, None) == 512
    assert resolve_prefill_chunk_size(None, None, True, 128) == 128
    assert resolve_prefill_chunk_size(128, None, True, 128) == 128
    with pytest.warns(DeprecationWarning, match="deprecated"):
        assert resolve_prefill_chunk_size(None, SchedulerConfig(prefill_chunk_size=32).prefill_chunk_size,
                                          None, None) == 32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for args in ((64, 32, None, None), (64, None, False, None), (64, None, True, 128), (None, None, False, 64)):
            with pytest.raises(ValueError):
                resolve_prefill_chunk_size(*args)
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        resolve_prefill_chunk_size(0, None, None, None)
    assert chunk_buckets(32, 80) == [Bucket(1, 32, 0), Bucket(1, 64, 32), Bucket(1, 80, 64)]
    assert chunk_buckets(16, 32) == [Bucket(1, 16, 0), Bucket(1, 32, 16)]


def _record_steps(llm):
    steps = []
    runner = llm.engine.runner
    execute = runner.execute

    def recording(batch):
        steps.append((batch.is_prefill, list(batch.num_new), batch.bucket))
        return execute(batch)

    runner.execute = recording
    return steps


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_chunked_prefill_interleaves_and_keeps_greedy_outputs(tiny_models, hf_llama, prefix_caching):
    llm = make_llm(tiny_models["llama"], enable_chunked_prefill=True, max_num_batched_tokens=16,
                   enable_prefix_caching=prefix_caching)
    assert llm.prefill_chunk_size == 16
    assert Bucket(1, 48, 32) in llm.buckets and {p.bucket for p in llm.pipelines} == set(llm.buckets)
    steps = _record_steps(llm)
    long_prompt = [(5 * i + 1) % 253 + 3 for i in range(100)]
    prompts = [[5, 6, 7], PREFIX[:12], long_prompt, long_prompt[:60] + [9, 9, 9] * 10]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 30, 10, 10)]
    outs = llm.generate(None, params, prompt_token_ids=prompts)
    for p, sp, o in zip(prompts, params, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_llama, p, sp.max_tokens)
    chunks = [i for i, (pre, new, _) in enumerate(steps) if pre and len(new) == 1 and new[0] == 16]
    assert len(chunks) >= 6 and llm.engine.stats.prefill_chunks >= 6
    # between two chunks of a long prompt the running requests decode
    first, last = chunks[0], chunks[-1]
    assert any(not steps[i][0] for i in range(first, last))
    assert all(n <= 16 for pre, new, _ in steps if pre for n in new)
    if prefix_caching:  # the 4th prompt shares 3 blocks (48 tokens) with the 3rd
        assert llm.engine.stats.prefix_cache_hits >= 48
    blocks = llm.engine.scheduler.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_usable_blocks


def test_chunked_prefill_prompt_logprobs(tiny_models, hf_llama):
    llm = make_llm(tiny_models["llama"], prefill_chunk_size=8)
    prompt = PREFIX[:30]
    out = llm.generate(None, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, ignore_eos=True),
                       prompt_token_ids=[prompt])[0]
    with torch.no_grad():
        lp = torch.log_softmax(hf_llama(torch.tensor([prompt])).logits[0], dim=-1)
    assert len(out.prompt_logprobs) == 30 and llm.engine.stats.prefill_chunks == 4
    for i in range(1, 30):
        assert out.prompt_logprobs[i][prompt[i]].logprob == pytest.approx(float(lp[i - 1, prompt[i]]), abs=1e-9)
    assert out.outputs[0].token_ids == hf_greedy(hf_llama, prompt, 3)


BEAM_CASES = [  # (beams, length_penalty, early_stopping, index of the greedy token used as an extra EOS)
    (2, 1.0, False, None), (4, 1.0, False, 3), (3, 0.5, True, 5), (4, 2.0, "never", 2), (2, -1.0, "never", 1),
    (4, 1.0, True, 0),
]


def hf_beams(model, prompt, k, n, max_new, length_penalty, early_stopping, eos):
    out = model.generate(torch.tensor([prompt]), do_sample=False, num_beams=k, num_return_sequences=n,
                         max_new_tokens=max_new, length_penalty=length_penalty, early_stopping=early_stopping,
                         eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    lens = (out.beam_indices >= 0).sum(-1).tolist()
    return [out.sequences[i, len(prompt):len(prompt) + lens[i]].tolist() for i in range(n)]


def beam_params(k, lp, es, extra_eos, n=None, max_tokens=20):
    return SamplingParams(use_beam_search=True, best_of=k, n=n or k, max_tokens=max_tokens, length_penalty=lp,
                          early_stopping=es, temperature=0,
                          stop_token_ids=[extra_eos] if extra_eos is not None else None)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_beam_search_equals_transformers(tiny_models, arch, llama_llm, hf_llama):
    if arch == "llama":
        llm, hf = llama_llm, hf_llama
    else:
        llm = make_llm(tiny_models[arch], max_seq_len_to_capture=128)
        hf = AutoModelForCausalLM.from_pretrained(str(tiny_models[arch]), dtype=torch.float64)
    prompt = PREFIX[:21]
    greedy = hf_greedy(hf, prompt, 8)
    for k, lp, es, extra in BEAM_CASES:
        eos = [2] + ([greedy[extra]] if extra is not None else [])
        for n in sorted({k, 1}):
            ours = llm.generate(None, beam_params(k, lp, es, eos[-1] if extra is not None else None, n),
                                prompt_token_ids=[prompt])[0]
            ref = hf_beams(hf, prompt, k, n, 20, lp, es, eos)
            assert [c.token_ids for c in ours.outputs] == ref, (arch, k, lp, es, n)
            for c in ours.outputs:
                assert c.finish_reason == ("stop" if c.token_ids[-1] in eos else "length")
    blocks = llm.engine.scheduler.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_usable_blocks


def test_beams_share_prompt_blocks_and_survive_preemption(tiny_models, hf_llama):
    """Three 4-beam requests at once in a cache too small for all of them: the prompt's KV blocks
    are stored once per request (every beam's table points at them), beams are preempted and
    recomputed, and the results still equal transformers'."""
    from fxcompiler.config import KvCacheSharingAcrossBeamsConfig

    llm = make_llm(tiny_models["llama"], paged_attention_block_size=4, paged_attention_num_blocks=48,
                   kv_cache_sharing_across_beams_config=KvCacheSharingAcrossBeamsConfig(4, 24))
    assert all(b.batch_size % 4 == 0 for b in llm.buckets if b.is_decode)
    steps = []
    runner = llm.engine.runner
    execute = runner.execute

    def recording(batch):
        if not batch.is_prefill:
            steps.append({s.request_id: [] for s in batch.seqs})
            for s in batch.seqs:
                steps[-1][s.request_id].append(runner.blocks.block_tables[s.slot, : len(s.prompt_token_ids) // 4]
                                               .tolist())
        return execute(batch)

    runner.execute = recording
    prompts = [PREFIX[:21], PREFIX[10:30], PREFIX[20:45]]
    outs = llm.generate(None, beam_params(4, 1.0, False, None, max_tokens=24), prompt_token_ids=prompts)
    for p, o in zip(prompts, outs):
        assert [c.token_ids for c in o.outputs] == hf_beams(hf_llama, p, 4, 4, 24, 1.0, False, [2])
    shared = [tables for step in steps for tables in step.values() if len(tables) == 4]
    assert shared and all(all(t == tables[0] for t in tables) for tables in shared)
    assert llm.engine.stats.preemptions > 0
    blocks = llm.engine.scheduler.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_usable_blocks
    for bad in (SamplingParams(max_tokens=4), beam_params(2, 1.0, False, None, max_tokens=4),
                beam_params(4, 1.0, False, None, max_tokens=30)):
        with pytest.raises(ValueError, match="kv_cache_sharing_across_beams_config"):
            llm.generate(None, bad, prompt_token_ids=[prompts[0]])
    assert not llm.engine.requests


def test_seeded_request_independent_of_the_batch(llama_llm):
    sp = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=12, seed=4242, ignore_eos=True)
    alone = llama_llm.generate(None, sp, prompt_token_ids=[PREFIX[:17]])[0].outputs[0].token_ids
    others = [SamplingParams(temperature=t, max_tokens=6 + i % 9, seed=None if i % 2 else i, ignore_eos=True)
              for i, t in enumerate([0.0, 0.5, 1.0, 1.5] * 8)]
    prompts = [PREFIX[i % 7:(i % 7) + 5 + i] for i in range(32)]
    outs = llama_llm.generate(None, others[:16] + [sp] + others[16:], prompt_token_ids=prompts[:16] + [PREFIX[:17]]
                              + prompts[16:])
    assert outs[16].outputs[0].token_ids == alone


@pytest.mark.slow
def test_300_requests_three_times_the_cache(tiny_models, hf_llama):
    """Total KV need ~3x the cache: requests are preempted and recomputed, all finish correct, no block leaks."""
    llm = make_llm(tiny_models["llama"], paged_attention_block_size=4, paged_attention_num_blocks=301)
    prompts = [[(i * 13 + j * 7) % 250 + 3 for j in range(4 + i % 12)] for i in range(300)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    need = sum(-(-(len(p) + 24) // 4) for p in prompts)
    assert need >= 3 * 300
    outs = llm.generate(None, sp, prompt_token_ids=prompts)
    roomy = make_llm(tiny_models["llama"], paged_attention_block_size=4, enable_prefix_caching=False)
    refs = roomy.generate(None, sp, prompt_token_ids=prompts)
    assert roomy.engine.stats.preemptions == 0
    for i, (p, o, r) in enumerate(zip(prompts, outs, refs)):
        assert o.finished and o.outputs[0].token_ids == r.outputs[0].token_ids
        if i % 15 == 0:
            assert o.outputs[0].token_ids == hf_greedy(hf_llama, p, 24)
    assert llm.engine.stats.preemptions > 0
    blocks = llm.engine.scheduler.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_usable_blocks


def test_custom_buckets_become_pipelines(tiny_models, hf_llama):
    extra = [Bucket.prefill(3, 40), Bucket(1, 64, 32), Bucket.decode(3, 128)]
    llm = make_llm(tiny_models["llama"], max_seq_len_to_capture=128, _custom_buckets=extra)
    assert set(extra) <= {p.bucket for p in llm.pipelines}
    assert Bucket.prefill(3, 40) in llm.engine.scheduler.prefill_buckets
    out = llm.generate(None, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), prompt_token_ids=[PREFIX])
    assert out[0].outputs[0].token_ids == hf_greedy(hf_llama, PREFIX, 5)
    with pytest.raises(TypeError, match="_custom_buckets"):
        make_llm(tiny_models["llama"], _custom_buckets=[(1, 32)])


def test_output_kinds_with_parallel_samples(llama_llm):
    """DELTA pieces add up to the CUMULATIVE/FINAL_ONLY result for every completion of an n=3 request."""
    from fxcompiler.sampling_params import RequestOutputKind

    engine = llama_llm.engine
    results = {}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        sp = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=7, ignore_eos=True, logprobs=1,
                            output_kind=kind)
        engine.add_request(f"kinds-{kind.name}", PREFIX[:10], sp)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        if kind == RequestOutputKind.FINAL_ONLY:
            assert len(outs) == 1
        if kind == RequestOutputKind.DELTA:
            toks = {i: [] for i in range(3)}
            lps = {i: [] for i in range(3)}
            for o in outs:
                for c in o.outputs:
                    toks[c.index] += c.token_ids
                    lps[c.index] += c.logprobs
            results[kind] = [toks[i] for i in range(3)]
            assert all(len(lps[i]) == 7 for i in range(3))
        else:
            results[kind] = [c.token_ids for c in outs[-1].outputs]
    assert results[RequestOutputKind.DELTA] == results[RequestOutputKind.CUMULATIVE] \
        == results[RequestOutputKind.FINAL_ONLY]


def test_everything_at_once_under_memory_pressure(tiny_models, hf_llama):
    """Chunked prefill, prefix reuse, parallel samples, beams and prompt logprobs in one small cache:
    every result still matches transformers and no block leaks."""
    llm = make_llm(tiny_models["llama"], paged_attention_block_size=4, paged_attention_num_blocks=32,
                   prefill_chunk_size=8)
    long = PREFIX + PREFIX[:20]
    prompts = [PREFIX[:30], PREFIX[:30] + [7, 7], long, PREFIX[:13], long[:50]]
    params = [SamplingParams(n=3, temperature=0.7, seed=5, max_tokens=16, ignore_eos=True, logprobs=0),
              beam_params(3, 1.0, False, None, max_tokens=12),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(n=2, best_of=3, temperature=1.2, max_tokens=10, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    outs = llm.generate(None, params, prompt_token_ids=prompts)
    for c in outs[0].outputs + outs[3].outputs:
        temp = 0.7 if c in outs[0].outputs else 1.2
        prompt = prompts[0] if c in outs[0].outputs else prompts[3]
        ref = hf_logprobs(hf_llama, prompt, c.token_ids, temp)
        ours = torch.tensor([next(iter(e.values())).logprob for e in c.logprobs], dtype=torch.float64)
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-9)
    assert [c.token_ids for c in outs[1].outputs] == hf_beams(hf_llama, prompts[1], 3, 3, 12, 1.0, False, [2])
    assert outs[2].outputs[0].token_ids == hf_greedy(hf_llama, long, 20)
    assert len(outs[2].prompt_logprobs) == len(long)
    assert outs[4].outputs[0].token_ids == hf_greedy(hf_llama, long[:50], 20)
    stats = llm.engine.stats
    assert stats.preemptions > 0 and stats.prefill_chunks > 0 and stats.prefix_cache_hits > 0
    blocks = llm.engine.scheduler.blocks
    blocks.check_invariants()
    assert blocks.num_free_blocks == blocks.num_usable_blocks


def test_beam_search_logprobs(llama_llm, hf_llama):
    prompt = PREFIX[:15]
    sp = SamplingParams(use_beam_search=True, best_of=3, n=2, max_tokens=8, temperature=0, logprobs=2)
    out = llama_llm.generate(None, sp, prompt_token_ids=[prompt])[0]
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        ref = hf_logprobs(hf_llama, prompt, c.token_ids)
        for step, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert entry[tok].logprob == pytest.approx(float(ref[step]), abs=1e-5)  # float32, as beam scores
            assert entry[tok].rank >= 1 and len(entry) in (2, 3)
        assert c.cumulative_logprob == pytest.approx(float(ref.sum()), abs=1e-4)


def test_the_stepping_threads_release_their_openmp_teams(llama_llm, monkeypatch):
    """generate releases its caller's OpenMP team when it returns and a stream's worker releases its own
    when the engine goes idle: one team at a time, or libgomp throttles every forward (runtime.openmp_team)."""
    import asyncio
    import threading

    from runtime import openmp_team

    released: list = []
    monkeypatch.setattr(openmp_team, "release", lambda: released.append(threading.current_thread()) or True)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llama_llm.generate(None, sp, prompt_token_ids=[[5, 6, 7, 8]])
    assert released == [threading.current_thread()]

    async def stream():  # no tokenizer: no text deltas, but the worker steps the request to its end
        return [d async for d in llama_llm.stream_generate("", sp, prompt_token_ids=[5, 6, 7])]

    released.clear()
    asyncio.run(stream())
    deadline = time.monotonic() + 10
    while not released and time.monotonic() < deadline:  # the worker releases after its last step
        time.sleep(0.01)
    assert released and all(t is not threading.current_thread() for t in released)


def test_generate_steps_on_the_calling_thread_and_alongside_a_stream(llama_llm):
    """Blocking generate runs engine steps on its own thread (OpenMP work stays on one thread);
    while a stream keeps the driver's worker busy it consumes the worker's outputs instead."""
    import threading
    import time

    engine = llama_llm.engine
    step, threads = engine.step, []
    # an earlier stream's last consumer call may have kicked the worker: it is idle once it has found nothing to step
    deadline = time.monotonic() + 10
    while llama_llm._driver.running and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not llama_llm._driver.running

    def recording_step():
        threads.append(threading.current_thread())
        return step()

    engine.step = recording_step
    try:
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        alone = llama_llm.generate(None, sp, prompt_token_ids=[[5, 6, 7, 8]])[0].outputs[0].token_ids
        assert threads and set(threads) == {threading.current_thread()}

        # a streaming consumer (what stream_generate does): its request is stepped by the driver's worker
        threads.clear()
        with llama_llm._lock:
            engine.add_request("streamed", [9, 10, 11], SamplingParams(temperature=0, max_tokens=60,
                                                                        ignore_eos=True), None)
            llama_llm._live.add("streamed")  # a caller waits for it (outputs of unregistered ids are dropped)
        streamed: list = []

        def consume():
            while not any(o.finished for o in streamed):
                llama_llm._step_and_dispatch()
                streamed.extend(llama_llm._pending.pop("streamed", []))

        consumer = threading.Thread(target=consume)
        consumer.start()
        deadline = time.monotonic() + 30
        while not threads and time.monotonic() < deadline:  # the worker has started stepping
            time.sleep(0.001)
        again = llama_llm.generate(None, sp, prompt_token_ids=[[5, 6, 7, 8]])[0].outputs[0].token_ids
        consumer.join(timeout=60)
        assert not consumer.is_alive() and again == alone
        assert any(t is not threading.current_thread() for t in threads)  # the worker stepped too
    finally:
        engine.step = step
        llama_llm._live.discard("streamed")
    blocks = engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_usable_blocks
