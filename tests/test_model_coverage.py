"""Greedy parity with transformers' ``generate`` for every architecture of ``fxcompiler.model_zoo``.

Random tiny configs of transformers' own classes (rope scaling variants, q/k norms, sliding-window
layers, soft-capping, attention sinks, mixture-of-experts, ...) go through ``LLM`` with the whole
default pipeline in float64: 8 prompts x 32 tokens, token for token. MoE references run
transformers' ``eager`` experts (its default ``grouped_mm`` has no fp64 CPU kernel).
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fxcompiler import LLM, SamplingParams
from fxcompiler.model_zoo import ZOO, zoo_names

from .test_llm_parity import PROMPTS

NEW_TOKENS = 32
# Phi-3 longrope: transformers re-prefills a sequence when it crosses original_max_position_embeddings
# (Phi3ForCausalLM.prepare_inputs_for_generation); fxcompiler keeps the short-factor keys of its prefix
# (docs/models.md). These prompts stay on one side: longer than 32 tokens, or one token (32 new ones end
# at position 31).
PHI3_PROMPTS = [list(range(10, 10 + n)) for n in (33, 40, 47, 64)] + [list(range(200, 160, -1)),
                                                                      [3] * 36, [42], [7]]


def save_zoo_model(root, name: str, seed: int = 0):
    from fxcompiler.model_zoo import zoo_config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(zoo_config(name), dtype=torch.float32)
    with torch.no_grad():  # spread the weights: near-uniform logits would make greedy parity meaningless
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    path = root / name
    model.save_pretrained(path)
    return path


def hf_reference(path):
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64)
    if getattr(hf.config, "_experts_implementation", "eager") not in (None, "eager"):
        hf.set_experts_implementation("eager")
    return hf


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


# Architectures whose fp64 greedy parity tests/test_llm_parity.py already asserts on its own tiny configs of
# the same classes (8 prompts x 64 tokens through fx, dfg and edf; Mistral's window is crossed there too).
COVERED_BY_LLM_PARITY = ("llama", "qwen2", "mistral", "gpt2")
PARITY_NAMES = [n for n in zoo_names() if n not in COVERED_BY_LLM_PARITY]


@pytest.fixture(scope="module")
def zoo_root(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


def _prompts(name):
    return PHI3_PROMPTS if name == "phi3" else PROMPTS


def _generate(path, name, kind="fx", **kw):
    llm = LLM(str(path), dtype="float64", max_seq_len_to_capture=256, comp_supertask_kind=kind, **kw)
    assert {t.kind.value for p in llm.pipelines for _, t in p.compute_supertasks()} == {kind}
    outs = llm.generate(None, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        prompt_token_ids=_prompts(name))  # the 8 prompts in one batch: continuous batching
    return llm, [o.outputs[0].token_ids for o in outs]


def _assert_parity(name, got, want):
    for prompt, g, w in zip(_prompts(name), got, want):
        assert g == w, f"{name}: prompt {prompt[:5]}...: fxcompiler {g} != transformers {w}"


@pytest.mark.slow
@pytest.mark.parametrize("name", PARITY_NAMES)
def test_zoo_greedy_parity_fp64(name, zoo_root):
    path = save_zoo_model(zoo_root, name)
    llm, got = _generate(path, name, cache_dir=None)
    hf = hf_reference(path)
    _assert_parity(name, got, [hf_greedy(hf, p, NEW_TOKENS) for p in _prompts(name)])
    nodes = llm._build.graph_module.graph.nodes
    attention = [n for n in nodes if "paged_attention" in str(n.target)]
    assert len(attention) == 2  # every layer's attention is the paged op (fused or not)
    if ZOO[name].moe:
        assert len([n for n in nodes if n.target == torch.ops.fxc.moe.default]) == 2  # every block is fxc::moe


@pytest.mark.slow
def test_moe_greedy_parity_every_supertask_kind(zoo_root, tmp_path):
    """A MoE through fx, dfg and edf (the three builds share one optimised program via the compile cache)."""
    name = "qwen3_moe"
    path = save_zoo_model(zoo_root, name, seed=1)
    hf = hf_reference(path)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in _prompts(name)]
    for kind in ("fx", "dfg", "edf"):
        llm, got = _generate(path, name, kind, cache_dir=str(tmp_path))  # edf: packages compiled in-process
        assert llm.build_info["compile_cache"] == ("miss" if kind == "fx" else "hit")
        _assert_parity(f"{name} ({kind})", got, want)


def test_zoo_names_and_unknown():
    assert len(zoo_names()) >= 16 and len(zoo_names(moe=True)) == 3
    assert set(COVERED_BY_LLM_PARITY) <= set(zoo_names())
    with pytest.raises(ValueError, match="unknown zoo architecture 'nope'"):
        from fxcompiler.model_zoo import zoo_config

        zoo_config("nope")


@pytest.mark.slow
def test_fusion_passes_preserve_semantics_on_zoo_architectures():
    """The fusion passes on graphs of the new architectures (sinks, softcap, q/k norms, experts)."""
    from fxcompiler import testing
    from fxcompiler.pass_manager import get_pass

    before = tuple(get_pass(n) for n in ("decompose", "strip_asserts", "fold_casts", "dce", "cse"))
    for name in ("gemma2", "qwen3", "gpt_oss", "mixtral"):
        program = testing.capture_zoo_model(name)
        inputs = testing.example_inputs(program, testing.TestBucket(2, 3, 20, 16))
        # transformers' Gemma2RMSNorm computes in float32 even in a float64 model (``x.float()``), so the
        # fused fxc::rms_norm (C++ kernel once loaded) rounds like any fp32 reduction: ~1e-7, not 1e-9
        tol = 1e-5 if name == "gemma2" else 1e-9
        for p in ("fuse_rms_norm", "fuse_rope"):
            testing.assert_pass_preserves_semantics(get_pass(p), program, inputs, passes_before=before,
                                                    rtol=tol, atol=tol)
