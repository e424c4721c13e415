"""Shared fixtures: tiny random-weight checkpoints of real transformers classes, saved locally."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Under pytest-xdist (scripts/test.sh runs one worker per core) each worker gets its share of
# the cores; oversubscribed intra-op threads would slow every worker down.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


def tiny_config(arch: str, **overrides):
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        cfg = LlamaConfig(**common)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
    elif arch == "mistral":
        cfg = MistralConfig(**common, sliding_window=32)
    elif arch == "gpt2":
        cfg = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                         bos_token_id=1, eos_token_id=2)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def save_tiny_model(path, arch: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Spread the weights so logits are not near-uniform (greedy ties would make parity meaningless).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: save_tiny_model(root / arch, arch) for arch in ("llama", "qwen2", "mistral", "gpt2")}


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")
