"""The worked example pass runs inside LLM(...) and its figures are right."""
from __future__ import annotations

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
