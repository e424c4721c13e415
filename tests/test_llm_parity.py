"""Greedy parity with transformers' own ``generate``: token for token.

Random-weight tiny configs of four real transformers classes run in float64 (exact
parity expected); prompts of different lengths are submitted together so continuous
batching batches prefills and joins requests while others decode.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fxcompiler import LLM, SamplingParams
from fxcompiler.config import SchedulerConfig
from fxcompiler.pipeline import ParamInfo

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [3] * 20,
    list(range(10, 50)),
    [7, 9],
    list(range(100, 113)),
    [42],
    list(range(200, 160, -1)) + list(range(60, 90)),
    [11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53],
]
NEW_TOKENS = 64


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["fx", "dfg", "edf"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_greedy_parity_random_configs_fp64(arch, kind, tiny_models):
    """Every supertask kind (edf: AOTInductor packages compiled here, no cache) is exact in fp64."""
    path = tiny_models[arch]
    kw = {"num_compile_workers": 2} if kind == "edf" else {}
    llm = LLM(str(path), dtype="float64", max_seq_len_to_capture=256, cache_dir=None, comp_supertask_kind=kind,
              **kw)
    assert {t.kind.value for p in llm.pipelines for _, t in p.compute_supertasks()} == {kind}
    outs = llm.generate(None, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        prompt_token_ids=PROMPTS)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64)
    for prompt, out in zip(PROMPTS, outs):
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS), f"{arch}: prompt {prompt[:5]}..."
    stats = llm.engine.stats
    assert stats.prefill_steps >= 2  # different lengths were not all padded into one prefill
    assert llm.engine.scheduler.blocks.num_free_blocks == llm.engine.scheduler.blocks.num_usable_blocks


def test_requests_join_while_others_decode(tiny_models):
    """At most 3 sequences at once and different max_tokens: later prompts enter mid-decode."""
    path = tiny_models["llama"]
    llm = LLM(str(path), dtype="float64", max_seq_len_to_capture=256, cache_dir=None,
              scheduler_config=SchedulerConfig(max_processing_samples=3))
    params = [SamplingParams(temperature=0, max_tokens=8 + 7 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    outs = llm.generate(None, params, prompt_token_ids=PROMPTS)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64)
    for prompt, p, out in zip(PROMPTS, params, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, p.max_tokens)
    assert llm.engine.stats.interleaved_prefills >= 3


def test_random_weight_model_matches_from_config(tiny_models):
    """use_random_weight builds the config's model with seeded weights (same seed, same model)."""
    from fxcompiler.models.loader import load_config

    path = tiny_models["qwen2"]
    a = LLM(str(path), use_random_weight=True, seed=7, dtype="float64", max_seq_len_to_capture=128, cache_dir=None)
    b = LLM(str(path), use_random_weight=True, seed=7, dtype="float64", max_seq_len_to_capture=128, cache_dir=None)
    c = LLM(str(path), use_random_weight=True, seed=8, dtype="float64", max_seq_len_to_capture=128, cache_dir=None)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ta, tb, tc = (x.generate(None, sp, prompt_token_ids=[PROMPTS[0]])[0].outputs[0].token_ids for x in (a, b, c))
    assert ta == tb and ta != tc
    torch.manual_seed(7)
    ref = AutoModelForCausalLM.from_config(load_config(path, None, False), dtype=torch.float64)
    assert ta == hf_greedy(ref, PROMPTS[0], 16)


def test_hf_overrides_change_the_model(tiny_models):
    llm = LLM(str(tiny_models["llama"]), hf_overrides={"num_hidden_layers": 1}, max_seq_len_to_capture=128,
              cache_dir=None)
    assert llm.model_config.num_hidden_layers == 1
    assert sum(1 for n in llm._build.graph_module.graph.nodes if "paged_attention" in str(n.target)) == 1


def test_furiosa_bucket_policies_keep_parity(tiny_models):
    """MinimalBucketConfig (batch 1, prompts padded to the largest prompt) and ManualBucketConfig."""
    from fxcompiler.config import ManualBucketConfig, MinimalBucketConfig

    path = str(tiny_models["mistral"])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = PROMPTS[:4]
    for cfg in (MinimalBucketConfig(max_seq_len=128), ManualBucketConfig([(2, 48), (1, 64)], [(1, 128), (4, 128)])):
        llm = LLM(path, dtype="float64", max_seq_len_to_capture=128, cache_dir=None, bucket_config=cfg)
        outs = llm.generate(None, sp, prompt_token_ids=prompts)
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 20)
        used = {p.bucket for p in llm.pipelines}
        assert used == set(llm.buckets)
    assert max(b.batch_size for b in llm.buckets if b.is_decode) == 4


@pytest.mark.parametrize("arch,embed,rewrite", [
    ("llama", True, False), ("gpt2", True, False),
    ("qwen2", False, True), ("gpt2", False, True),
    ("mistral", True, True), ("llama", True, True),
])
def test_greedy_parity_under_constant_embedding_and_model_rewrite(arch, embed, rewrite, tiny_models):
    """Parity still holds for every combination of ``embed_all_constants_into_graph`` and
    ``do_decompositions_for_model_rewrite`` (the default combination is the test above)."""
    path = tiny_models[arch]
    llm = LLM(str(path), dtype="float64", max_seq_len_to_capture=256, cache_dir=None,
              embed_all_constants_into_graph=embed, do_decompositions_for_model_rewrite=rewrite)
    history = {h["pass"]: h for h in llm.pass_history}
    assert history["constants"]["embedded"] > 0 if embed else history["constants"]["param_inputs"] > 0
    if embed:
        assert not any(isinstance(t, ParamInfo) for t in llm.pipelines[0].tensors.values())
    prompts = PROMPTS[:4]
    outs = llm.generate(None, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), prompt_token_ids=prompts)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 32), f"{arch}: prompt {prompt[:5]}..."
