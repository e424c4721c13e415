"""Unsupported architectures fail at ``LLM(...)`` with an error naming the architecture and the construct."""
from __future__ import annotations

import json

import pytest
import torch

from fxcompiler import LLM
from fxcompiler.models.support_check import UnsupportedModelError


def _save(model_or_config, path):
    model_or_config.save_pretrained(path)  # a model (weights + config) or a config alone
    return str(path)


def test_custom_attention_is_named_with_its_source_line(tmp_path):
    """Bloom's ALiBi attention does not go through transformers' attention interface."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    path = _save(BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)), tmp_path / "b")
    with pytest.raises(UnsupportedModelError) as e:
        LLM(path, max_seq_len_to_capture=64, cache_dir=None)
    msg = str(e.value)
    assert msg.startswith("BloomForCausalLM: only 0 of 2 layers' attention")
    assert "softmax" in msg and "modeling_bloom.py" in msg


def test_encoder_decoder_is_refused(tmp_path):
    from transformers import T5Config

    path = _save(T5Config(vocab_size=64, d_model=32, num_layers=1, num_heads=2, d_ff=64,
                          architectures=["T5ForConditionalGeneration"]), tmp_path / "t5")
    with pytest.raises(UnsupportedModelError, match=r"^T5ForConditionalGeneration: encoder-decoder .* cross-attention"):
        LLM(path, max_seq_len_to_capture=64, cache_dir=None, use_random_weight=True)


def test_config_naming_no_known_class(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "fancy_new_lm", "architectures":
                                                      ["FancyNewForCausalLM"], "vocab_size": 10}))
    with pytest.raises(UnsupportedModelError, match=r"^FancyNewForCausalLM: .* model_type 'fancy_new_lm'"):
        LLM(str(tmp_path), max_seq_len_to_capture=64, cache_dir=None, use_random_weight=True)


def test_no_causal_lm_class(tmp_path):
    from transformers import ViTConfig

    path = _save(ViTConfig(architectures=["ViTModel"]), tmp_path / "vit")
    with pytest.raises(UnsupportedModelError, match=r"^ViTModel: model_type 'vit' has no causal-LM class"):
        LLM(path, max_seq_len_to_capture=64, cache_dir=None, use_random_weight=True)


def test_encoder_task_types_raise_naming_the_reason(tiny_models):
    """Encoder tasks are built for BERT-style checkpoints (tests/test_encoder_tasks.py); a decoder's QA head is not."""
    with pytest.raises(UnsupportedModelError, match=r"^LlamaForCausalLM \(model_type 'llama'\) with task "
                                                    r"'question-answering': encoder tasks are built for BERT"):
        LLM(str(tiny_models["llama"]), task_type="question-answering", cache_dir=None)
    llm = LLM.__new__(LLM)  # a text-generation LLM: the methods refuse before touching the instance
    for call, match in ((lambda: llm.embed(["a"]), "LLM.embed"), (lambda: llm.score("a", "b"), "LLM.score"),
                        (lambda: llm.bert_forward(["q"], ["c"]), "LLM.bert_forward")):
        with pytest.raises(ValueError, match=rf"^{match} needs an LLM built with .*this LLM's task is 'text-generation'"):
            call()
