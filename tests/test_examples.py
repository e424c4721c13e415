"""The worked example pass runs inside LLM(...) and its figures are right."""
from __future__ import annotations

import pytest

from examples.count_matmul_flops import count_matmul_flops
from fxcompiler import LLM


def test_flop_counter_pass_inside_llm(tiny_models):
    from transformers import AutoModelForCausalLM

    path = str(tiny_models["llama"])
    llm = LLM(path, max_seq_len_to_capture=128, cache_dir=None, skip_engine=True,
              compiler_config_overrides={"passes": {"insert": [(count_matmul_flops, {"after": "fuse_projections"})]}})
    info = next(h for h in llm.pass_history if h["pass"] == "count_matmul_flops")
    hf = AutoModelForCausalLM.from_pretrained(path)
    linear_params = sum(m.weight.numel() for m in hf.modules() if isinstance(m, __import__("torch").nn.Linear))
    assert info["flops_per_token"] == 2 * linear_params
    assert set(info["per_layer"]) == {"layer0", "layer1", "head"}
    assert info["per_layer"]["layer0"] == info["per_layer"]["layer1"]


def _greedy(llm, prompts, n=16):
    from fxcompiler import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(None, sp, prompt_token_ids=prompts)]


def _with_swiglu():
    from examples.fuse_swiglu import fuse_swiglu

    return {"passes": {"insert": [(fuse_swiglu, {"after": "fuse_projections", "must_fire": True})]}}


def test_pattern_matcher_example_fires_and_keeps_greedy_output(tiny_models):
    path = str(tiny_models["llama"])
    kw = dict(max_seq_len_to_capture=128, cache_dir=None, dtype="float32")
    fused = LLM(path, compiler_config_overrides=_with_swiglu(), **kw)
    info = next(h for h in fused.pass_history if h["pass"] == "fuse_swiglu")
    assert info["fused"] == 2
    graph = fused._build.graph_module.code
    assert "example.swiglu" in graph and "fxc.silu_mul" not in graph
    prompts = [[1, 2, 3, 4, 5], list(range(20, 40))]
    assert _greedy(fused, prompts) == _greedy(LLM(path, **kw), prompts)


@pytest.mark.slow
def test_pattern_matcher_example_on_smollm2():
    from fxcompiler.models.sources import DEFAULT_MODEL_ID

    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
                8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]]
    fused = LLM(DEFAULT_MODEL_ID, max_seq_len_to_capture=256, cache_dir=None, compiler_config_overrides=_with_swiglu())
    assert next(h for h in fused.pass_history if h["pass"] == "fuse_swiglu")["fused"] == 30
    base = LLM(DEFAULT_MODEL_ID, max_seq_len_to_capture=256, cache_dir=None)
    assert _greedy(fused, prompts, 24) == _greedy(base, prompts, 24)
