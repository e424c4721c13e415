"""Blockwise partition (``passes/blockwise.py``), the blockwise pipelines and their executor.

Captures are the expensive part (≈0.4 s per layer for ``torch.export``): the property test
draws from a small pool of captured models (cached for the session) and the partitions
and executables built from them are cached per ``num_blocks_per_supertask``.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.fx import FxExecutable
from fxcompiler import testing
from fxcompiler.capture import capture
from fxcompiler.pipeline import Bucket, ParamInfo, SuperTaskKind
from fxcompiler.pipeline_builder import build_pipelines, optimise
from passes.blockwise import discover_layer_prefix, partition_blockwise

NO_TUNER = {"passes": {"disable": ["lower_cpu_kernels"]}}  # no kernel build/measurement in unit tests
CPU = torch.device("cpu")


def _random_model(cfg, seed=0, dtype=torch.float64, edit=None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    if edit is not None:
        edit(model)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    return model


def _uneven_llama():
    """Layer 1's MLP is wider than the others' (what per-layer size overrides produce)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=256)

    def widen(model):
        wide = copy.deepcopy(cfg)
        wide.intermediate_size = 40
        model.model.layers[1].mlp = LlamaMLP(wide).to(torch.float64)

    return _random_model(cfg, edit=widen)


def _sliding_qwen2():
    """Layers 0-1 attend to everything, layers 2-3 through a sliding window."""
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=256, use_sliding_window=True, sliding_window=8,
                      max_window_layers=2)
    assert cfg.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    return _random_model(cfg)


POOL = {
    "gpt2": lambda: testing.capture_tiny_model(testing.TinyConfig("gpt2", 2, 16, 2, 2, 64, 24)),
    "qwen2_sliding": lambda: capture(_sliding_qwen2()),
    "llama_uneven": lambda: capture(_uneven_llama()),
}


@functools.cache
def _captured(kind):
    return POOL[kind]()


@functools.cache
def _graph(kind, optimised: bool):
    """(program, graph, context): the captured graph, or the default pass pipeline's output."""
    program = _captured(kind)
    if not optimised:
        return program, program.graph_module, testing.context_of(program)
    gm, ctx = optimise(testing.copy_program(program), NO_TUNER)
    return program, gm, ctx


@functools.cache
def _executables(kind, optimised: bool, k: int):
    """(blockwise executable, single-supertask executable, pipeline) for one graph."""
    program, gm, ctx = _graph(kind, optimised)
    buckets = [Bucket.prefill(2, 32)]
    blockwise = build_pipelines(program, buckets, kind, optimised=(gm, ctx),
                                options={"num_blocks_per_supertask": k}).pipelines[0]
    single = build_pipelines(program, buckets, kind, optimised=(gm, ctx),
                             options={"use_blockwise_compile": False}).pipelines[0]
    return FxExecutable(blockwise, ctx.params, CPU), FxExecutable(single, ctx.params, CPU), blockwise


def _blocks(partition):
    return [p for p in partition.parts if p.role == "block"]


def test_layer_prefix_is_discovered_from_parameter_names():
    names = [f"model.model.layers.{i}.mlp.experts.{j}.w1" for i in range(3) for j in range(8)]
    names += ["model.model.embed_tokens.weight", "model.lm_head.weight.T",
              "model.model.layers.0.q.weight.T+model.model.layers.0.k.weight.T"]
    assert discover_layer_prefix(names, 3) == ("model.model.layers", [0, 1, 2])
    assert discover_layer_prefix(["model.transformer.h.0.ln_1.weight", "model.transformer.h.1.ln_1.weight"]) == \
        ("model.transformer.h", [0, 1])
    assert discover_layer_prefix(["model.embed.weight"]) is None


def test_uniform_30_layer_llama_shares_one_block_blob():
    cfg = testing.TinyConfig("llama", layers=30, hidden=16, heads=2, kv_heads=1, vocab=32, intermediate=16)
    program = testing.capture_tiny_model(cfg, dtype=torch.float32)
    ctx = testing.context_of(program)
    part = partition_blockwise(program.graph_module, ctx)
    assert part.layer_prefix == "model.model.layers" and part.layers == list(range(30))
    assert [p.role for p in part.parts] == ["embed"] + ["block"] * 30 + ["head"]
    blocks = _blocks(part)
    assert len(part.block_blobs) == 1 and len(part.blobs) == 3
    assert all(b.graph_module is blocks[0].graph_module for b in blocks)  # one compiled executable
    for i, b in enumerate(blocks):
        assert b.layers == (i,)
        assert b.params and all(f"layers.{i}." in target for _, target in b.params)  # own bindings
        assert [ph for ph, _ in b.params] == [ph for ph, _ in blocks[0].params]
        assert f"k_caches_{i}" in b.inputs and f"v_caches_{i}" in b.inputs
        assert b.inputs[0] == (blocks[i - 1].outputs[0] if i else "embed_out0")  # residual stream in ...
        assert b.outputs == [f"block{i}_out0"]  # ... and out
    assert part.parts[-1].outputs == ["logits"] and part.parts[-1].inputs[0] == "block29_out0"

    merged = partition_blockwise(program.graph_module, ctx, num_blocks_per_supertask=4)
    blocks = _blocks(merged)
    assert [len(b.layers) for b in blocks] == [4] * 7 + [2]
    assert len(merged.block_blobs) == 2  # the shorter last supertask has its own blob
    assert len({id(b.graph_module) for b in blocks[:7]}) == 1
    assert len(partition_blockwise(program.graph_module, ctx, num_blocks_per_supertask=3).block_blobs) == 1

    # The pipelines: input -> embed -> 30 blocks -> head -> output, named intermediates.
    result = build_pipelines(program, [Bucket.prefill(2, 16), Bucket.decode(4, 64)], "tiny", optimised=(
        program.graph_module, ctx), options={"num_blocks_per_supertask": 1, "num_blocks_per_pp_stage": [15, 15]})
    for pipe in result.pipelines:
        kinds = [t.kind for t in pipe.supertasks.values()]
        assert kinds == [SuperTaskKind.INPUT] + [SuperTaskKind.FX] * 32 + [SuperTaskKind.OUTPUT]
        assert len(pipe.blobs) == 3
        assert pipe.metadata["num_blocks_per_pp_stage"] == [15, 15]
        assert pipe.metadata["blockwise"]["unique_block_blobs"] == 1
        b, t = pipe.bucket.batch_size, pipe.bucket.input_ids_size
        assert pipe.tensors["block3_out0"].shape == [b, t, 16]
        assert isinstance(pipe.tensors["p_model_model_layers_3_mlp_up_proj_weight"], ParamInfo)
        pipe.to_json()


def test_differing_layers_get_their_own_blobs():
    _, gm, ctx = _graph("qwen2_sliding", True)
    blocks = _blocks(partition_blockwise(gm, ctx))
    assert [b.blob_id == blocks[0].blob_id for b in blocks] == [True, True, False, False]
    assert blocks[2].blob_id == blocks[3].blob_id

    _, gm, ctx = _graph("llama_uneven", True)
    part = partition_blockwise(gm, ctx)
    blocks = _blocks(part)
    assert len(part.block_blobs) == 2
    assert blocks[0].blob_id == blocks[2].blob_id != blocks[1].blob_id


def test_tied_parameters_are_bound_once():
    """GPT-2 ties lm_head to the token embedding: in the captured graph the embedding and the
    head read the same parameter, which both supertasks bind to one tensor."""
    exe, _, pipe = _executables("gpt2", False, 1)
    readers = [t for t in pipe.compute_supertasks() if "p_model_lm_head_weight" in t[1].inputs]
    assert [t.metadata["part"] for _, t in readers] == ["embed", "head"]
    assert len(exe.graph_modules) == 3 and len(exe._plan) == 4
    embed_bound, head_bound = exe._plan[0][1], exe._plan[-1][1]
    tied = [t for t in embed_bound if any(t is u for u in head_bound)]
    assert len(tied) == 1 and tied[0].shape == (64, 16)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(POOL)), optimised=st.booleans(), k=st.integers(1, 4),
       bucket=testing.buckets(max_batch=2, max_tokens=6, max_context=24))
def test_blockwise_pipeline_computes_what_the_whole_graph_computes(kind, optimised, k, bucket):
    program, gm, ctx = _graph(kind, optimised)
    exe, single, pipe = _executables(kind, optimised, k)
    groups = -(-program.geometry.num_layers // k)
    assert len(pipe.compute_supertasks()) == groups + 2
    inputs = testing.example_inputs(program, bucket, seed=bucket.tokens)
    expected_logits, expected_caches = testing.run_program(gm, ctx, inputs)
    targets = pipe.metadata["inputs"]
    for run in (exe, single):
        fresh = {name: t.clone() for name, t in inputs.items()}
        with torch.no_grad():
            logits = run(*[fresh[targets[n]] for n in run.user_inputs])
        torch.testing.assert_close(logits, expected_logits, rtol=1e-10, atol=1e-10)
        for name, cache in expected_caches.items():  # KV caches written in place by every block
            torch.testing.assert_close(fresh[name], cache, rtol=1e-10, atol=1e-10)


def test_llm_greedy_generation_same_with_blockwise_on_and_off(tiny_models):
    from fxcompiler import LLM, SamplingParams

    prompts = [[5, 6, 7, 8, 9], list(range(10, 40)), [3] * 12]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    runs = {}
    for name, kwargs in (("on", {"num_blocks_per_supertask": 2}), ("off", {"use_blockwise_compile": False})):
        llm = LLM(str(tiny_models["llama"]), max_seq_len_to_capture=128, cache_dir=None,
                  compiler_config_overrides=NO_TUNER, **kwargs)
        pipe = llm.pipelines[0]
        assert len(pipe.compute_supertasks()) == (3 if name == "on" else 1)  # 2 layers, 2 per supertask
        outs = llm.generate(None, sp, prompt_token_ids=prompts)
        runs[name] = [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]
    on, off = runs["on"], runs["off"]
    assert [t for t, _ in on] == [t for t, _ in off]
    for (_, a), (_, b) in zip(on, off):
        for x, y in zip(a, b):
            assert [k for k, _ in x] == [k for k, _ in y]
            assert [v.logprob for _, v in x] == pytest.approx([v.logprob for _, v in y], abs=1e-5)
