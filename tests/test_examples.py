"""The worked example pass runs inside LLM(...) and its figures are right."""
from __future__ import annotations


from examples.count_matmul_flops import count_matmul_flops
from fxcompiler import LLM


def test_flop_counter_pass_inside_llm(tiny_models, tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    path = str(tiny_models["llama"])
    llm = LLM(path, max_seq_len_to_capture=128, cache_dir=None, skip_engine=True,
              compiler_config_overrides={"passes": {"insert": [(count_matmul_flops, {"after": "fuse_projections"})]},
                                         "dump_dir": str(tmp_path)})
    info = next(h for h in llm.pass_history if h["pass"] == "count_matmul_flops")
    # as its docstring says: the figures are in pass_history and in the dump's summary.json
    dumped = next(s for s in json.loads((tmp_path / "summary.json").read_text()) if s["pass"] == "count_matmul_flops")
    assert dumped["per_layer"] == info["per_layer"] and dumped["flops_per_token"] == info["flops_per_token"]
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
