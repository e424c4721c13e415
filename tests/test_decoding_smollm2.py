"""Beam search, prefix reuse and chunked prefill on the embedded SmolLM2-135M-Instruct (fp32, real weights)."""
from __future__ import annotations

import pytest
import torch

from fxcompiler import LLM, SamplingParams
from fxcompiler.models.loader import model_directory
from fxcompiler.models.sources import DEFAULT_MODEL_ID, resolve_model_source

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL_ID, max_seq_len_to_capture=512, prefill_chunk_size=32)


@pytest.fixture(scope="module")
def hf_model(llm):
    from transformers import AutoModelForCausalLM

    path = model_directory(resolve_model_source(DEFAULT_MODEL_ID), llm.cache_dir)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("k", [2, 4])
def test_beam_search_equals_transformers_fp32(llm, hf_model, k):
    eos = sorted(llm.engine.eos_token_ids)
    for prompt in PROMPTS:
        ids = llm.tokenizer(prompt)["input_ids"]
        sp = SamplingParams(use_beam_search=True, best_of=k, n=k, max_tokens=24, temperature=0,
                            length_penalty=1.0, early_stopping=False)
        ours = llm.generate(prompt, sp)
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), do_sample=False, num_beams=k, num_return_sequences=k,
                                    max_new_tokens=24, length_penalty=1.0, early_stopping=False, eos_token_id=eos,
                                    pad_token_id=eos[0], return_dict_in_generate=True, output_scores=True)
        lens = (out.beam_indices >= 0).sum(-1).tolist()
        ref = [out.sequences[i, len(ids):len(ids) + lens[i]].tolist() for i in range(k)]
        assert [c.token_ids for c in ours.outputs] == ref, prompt


def test_prefix_reuse_and_chunks_keep_greedy_outputs(llm):
    system = "You are a helpful assistant. " * 12
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(DEFAULT_MODEL_ID, max_seq_len_to_capture=512, enable_prefix_caching=False)
    prompts = [system + q for q in ("What is 2+2?", "Name a colour.", "Say hello.")]
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    hits = llm.engine.stats.prefix_cache_hits
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == ref
    assert llm.engine.stats.prefix_cache_hits > hits
