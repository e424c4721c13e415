"""End-to-end decoding features against transformers on fp64 tiny models: prefix reuse,
parallel sampling (n / best_of), prompt logprobs, chunked prefill, beam search."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fxcompiler import LLM, SamplingParams

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
    return LLM(str(path), dtype="float64", cache_dir=None, **kw)


@pytest.mark.parametrize("block_size", [16, 4])
def test_prefix_reuse_greedy_identical(tiny_models, hf_llama, block_size):
    llm = make_llm(tiny_models["llama"], paged_attention_block_size=block_size)
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
