"""Tiny (and mid-size) configs of transformers' own decoder classes, one per supported architecture.

Used by the parity tests (``tests/test_model_coverage.py``), the support table
(``fxcompiler models``) and the per-architecture decode benchmark. Each entry builds a
real ``transformers`` config whose model class is the one a user's checkpoint names, with the
architecture's distinguishing constructs switched on (rope scaling, q/k norms, sliding-window
layers, soft-capping, sinks, experts, ...). Sizes are tiny on purpose: every config is exported
once per test session.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["ZOO", "ZooEntry", "zoo_config", "zoo_names"]

_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@dataclass(frozen=True)
class ZooEntry:
    """One architecture: how to build its config, what it exercises, and whether it is a MoE."""

    name: str
    model_class: str  # the transformers class a checkpoint's ``architectures`` names
    constructs: str  # what the config exercises (for the support table)
    build: Callable[[dict], object]  # base sizes -> transformers config
    moe: bool = False


def _t():
    import transformers

    return transformers


def _rope(kind: str, **extra) -> dict:
    return {"rope_type": kind, "rope_theta": 10000.0, **extra}


def _llama(rope=None):
    def build(b):
        cfg = _t().LlamaConfig(**b)
        if rope is not None:
            cfg.rope_parameters = rope
        return cfg
    return build


def _sliding(n, pattern=("sliding_attention", "full_attention")):
    return [pattern[i % len(pattern)] for i in range(n)]


def _gemma2(b):
    return _t().Gemma2Config(**b, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                             attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                             layer_types=_sliding(b["num_hidden_layers"]))


def _gemma3(b):
    return _t().Gemma3TextConfig(**b, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                 final_logit_softcapping=30.0, attn_logit_softcapping=None,
                                 layer_types=_sliding(b["num_hidden_layers"]))


def _phi3(b):
    half = b["hidden_size"] // b["num_attention_heads"] // 2
    return _t().Phi3Config(**b, original_max_position_embeddings=32, rope_parameters=_rope(
        "longrope", short_factor=[1.0 + 0.05 * i for i in range(half)], long_factor=[1.5 + 0.1 * i for i in range(half)],
        original_max_position_embeddings=32))


def _gptj(b):
    return _t().GPTJConfig(vocab_size=b["vocab_size"], n_embd=b["hidden_size"], n_layer=b["num_hidden_layers"],
                           n_head=b["num_attention_heads"], rotary_dim=8, n_positions=512,
                           n_inner=b["intermediate_size"], bos_token_id=1, eos_token_id=2)


def _gpt2(b):
    return _t().GPT2Config(vocab_size=b["vocab_size"], n_embd=b["hidden_size"], n_layer=b["num_hidden_layers"],
                           n_head=b["num_attention_heads"], n_positions=512, n_inner=b["intermediate_size"],
                           bos_token_id=1, eos_token_id=2)


def _stablelm(b):
    return _t().StableLmConfig(**b, qk_layernorm=True, use_parallel_residual=False,
                               rope_parameters=_rope("default", partial_rotary_factor=0.5))


def _exaone4(b):
    return _t().Exaone4Config(**b, sliding_window=8, sliding_window_pattern=2,
                              layer_types=_sliding(b["num_hidden_layers"]))


def _granite(b):
    return _t().GraniteConfig(**b, embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.2,
                              logits_scaling=2.0)


def _mixtral(b):
    return _t().MixtralConfig(**b, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)


def _qwen3_moe(b):
    return _t().Qwen3MoeConfig(**b, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                               decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[], head_dim=16)


def _gpt_oss(b):
    b = dict(b)
    b.pop("num_hidden_layers")
    return _t().GptOssConfig(**b, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                             sliding_window=8, layer_types=_sliding(2), attention_bias=True)


_ENTRIES = [
    ZooEntry("llama", "LlamaForCausalLM", "GQA, RoPE", _llama()),
    ZooEntry("llama3_rope", "LlamaForCausalLM", "rope_type llama3",
             _llama(_rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64))),
    ZooEntry("llama_linear_rope", "LlamaForCausalLM", "rope_type linear", _llama(_rope("linear", factor=2.0))),
    ZooEntry("llama_dynamic_rope", "LlamaForCausalLM", "rope_type dynamic (NTK)",
             _llama(_rope("dynamic", factor=2.0, original_max_position_embeddings=32))),
    ZooEntry("llama_yarn_rope", "LlamaForCausalLM", "rope_type yarn",
             _llama(_rope("yarn", factor=4.0, original_max_position_embeddings=64))),
    ZooEntry("qwen2", "Qwen2ForCausalLM", "q/k/v bias", lambda b: _t().Qwen2Config(**b)),
    ZooEntry("qwen3", "Qwen3ForCausalLM", "q/k RMSNorm per head",
             lambda b: _t().Qwen3Config(**b, head_dim=16)),
    ZooEntry("mistral", "MistralForCausalLM", "sliding window",
             lambda b: _t().MistralConfig(**b, sliding_window=12)),
    ZooEntry("gpt2", "GPT2LMHeadModel", "LayerNorm, learned positions, Conv1D", _gpt2),
    ZooEntry("gptj", "GPTJForCausalLM", "parallel attention/MLP, partial interleaved rotary", _gptj),
    ZooEntry("exaone4", "Exaone4ForCausalLM", "q/k norm, post-norms, sliding/full layers", _exaone4),
    ZooEntry("gemma2", "Gemma2ForCausalLM", "softcap (attn + final), sliding/full layers, (1+w) norms, "
             "pre/post norms, scaled embeddings", _gemma2),
    ZooEntry("gemma3", "Gemma3ForCausalLM", "q/k norm, final softcap, sliding/full layers (local rope), "
             "(1+w) norms, pre/post norms, scaled embeddings", _gemma3),
    ZooEntry("phi3", "Phi3ForCausalLM", "fused qkv and gate/up, longrope", _phi3),
    ZooEntry("olmo2", "Olmo2ForCausalLM", "q/k norm over all heads, post-norms",
             lambda b: _t().Olmo2Config(**b)),
    ZooEntry("granite", "GraniteForCausalLM", "embedding/residual/attention multipliers, logits scaling", _granite),
    ZooEntry("stablelm", "StableLmForCausalLM", "LayerNorm, partial rotary, per-head q/k LayerNorm", _stablelm),
    ZooEntry("mixtral", "MixtralForCausalLM", "MoE top-2 of 4 (softmax then top-k)", _mixtral, moe=True),
    ZooEntry("qwen3_moe", "Qwen3MoeForCausalLM", "MoE top-2 of 8 (normalised top-k), q/k norm", _qwen3_moe,
             moe=True),
    ZooEntry("gpt_oss", "GptOssForCausalLM", "MoE top-2 of 4 (top-k then softmax, clamped swiglu, biases), "
             "attention sinks, sliding/full layers", _gpt_oss, moe=True),
]

ZOO: dict[str, ZooEntry] = {e.name: e for e in _ENTRIES}


def zoo_names(moe: bool | None = None) -> list[str]:
    """Names of the zoo's architectures (only MoE ones, only dense ones, or all)."""
    return [e.name for e in _ENTRIES if moe is None or e.moe == moe]


def zoo_config(name: str, **sizes):
    """A transformers config of architecture ``name`` (tiny unless ``sizes`` override the base sizes:
    ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``, ...)."""
    if name not in ZOO:
        raise ValueError(f"unknown zoo architecture {name!r}; expected one of {sorted(ZOO)}")
    base = dict(_BASE)
    unknown = set(sizes) - set(base)
    if unknown:
        raise ValueError(f"zoo_config: unknown size keys {sorted(unknown)}; expected some of {sorted(base)}")
    base.update(sizes)
    return ZOO[name].build(base)
