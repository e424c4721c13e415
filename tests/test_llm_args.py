"""Argument validation of LLM(...) and capability gating (fast: fails before loading weights)."""
from __future__ import annotations

import pytest

from fxcompiler import LLM
from fxcompiler.config import ManualBucketConfig, MinimalBucketConfig, SchedulerConfig
from fxcompiler.pipeline import Bucket, Device, parse_devices


def test_unknown_model_id_fails_fast_and_says_where_it_looked():
    with pytest.raises(ValueError) as e:
        LLM("no-such-org/no-such-model")
    msg = str(e.value)
    assert "no-such-org/no-such-model" in msg and "Looked in" in msg and "Hugging Face cache" in msg


@pytest.mark.parametrize("devices, match", [("gpu:0", "invalid device"), ("npu:0", "NPU"), ("cpu:x", "invalid"),
                                            ("", "at least one")])
def test_bad_device_strings(devices, match, tiny_models):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_models["llama"]), devices=devices)


def test_device_parsing():
    assert parse_devices("cpu") == ["cpu"]
    assert parse_devices("cuda:0,cuda:1")[1].idx == 1
    assert Device("cuda:3").kind == "cuda"
    with pytest.raises(TypeError):
        parse_devices(3)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(tokenizer_mode="fast"), ValueError, "tokenizer_mode"),
    (dict(max_seq_len_to_capture=0), ValueError, "max_seq_len_to_capture"),
    (dict(paged_attention_block_size=0), ValueError, "paged_attention_block_size"),
    (dict(param_saved_format="npz"), ValueError, "param_saved_format"),
    (dict(packing_type="GREEDY"), ValueError, "packing_type"),
    (dict(comp_supertask_kind="tvm"), ValueError, "comp_supertask_kind"),
    (dict(backend="FURIOSA_RT_V2"), ValueError, "NPU"),
    (dict(backend="nonsense"), ValueError, "backend"),
    (dict(scheduler_config={"npu_queue_limit": 2}), TypeError, "scheduler_config"),
    (dict(no_such_argument=1), TypeError, "no_such_argument"),
    (dict(pipeline_parallel_size=3, max_seq_len_to_capture=128), ValueError, "pipeline_parallel_size=3 needs at least 3 blocks; the model has 2"),
    (dict(data_parallel_size=0), ValueError, "data_parallel_size must be a positive int"),
    (dict(tensor_parallel_size=3, max_seq_len_to_capture=128), ValueError, "does not divide the 4 query heads"),
    (dict(prefill_chunk_size=64, scheduler_config=SchedulerConfig(prefill_chunk_size=32)), ValueError, "conflicts"),
    (dict(enable_chunked_prefill=False, prefill_chunk_size=64), ValueError, "conflicts"),
    (dict(enable_prefix_caching="yes"), TypeError, "enable_prefix_caching"),
    (dict(speculative_model="[ngram]", num_speculative_tokens=0), ValueError, "num_speculative_tokens"),
    (dict(num_compile_workers=0), ValueError, "num_compile_workers"),
    (dict(artifacts_export_path=3), TypeError, "artifacts_export_path"),
    (dict(use_blockwise_compile="yes"), TypeError, "use_blockwise_compile"),
    (dict(qformat_path="q.yaml"), ValueError, "qformat_path='q.yaml' cannot be read"),
    (dict(quant_ckpt_file_path="q.safetensors"), ValueError, "quant_ckpt_file_path='q.safetensors' does not exist"),
    (dict(hf_overrides={"a": 1}, config={"b": 2}), ValueError, "hf_overrides"),
])
def test_bad_and_not_yet_supported_arguments(kwargs, exc, match, tiny_models):
    with pytest.raises(exc, match=match):
        LLM(str(tiny_models["llama"]), **kwargs)


def test_max_seq_len_beyond_model_positions(tiny_models):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(str(tiny_models["llama"]), max_seq_len_to_capture=4096, cache_dir=None)


def test_max_prompt_len_beyond_buckets(tiny_models):
    with pytest.raises(ValueError, match="max_prompt_len"):
        LLM(str(tiny_models["llama"]), bucket_config=ManualBucketConfig([(1, 64)], [(1, 128)]), max_prompt_len=100,
            max_seq_len_to_capture=128, cache_dir=None)


def test_bucket_and_scheduler_config_validation():
    with pytest.raises(ValueError, match="prefill_buckets"):
        ManualBucketConfig([(1,)], [(1, 64)])
    with pytest.raises(ValueError, match="decode_buckets"):
        ManualBucketConfig([(1, 32)]).buckets(32, 64)
    with pytest.raises(ValueError, match="spare_blocks_ratio"):
        SchedulerConfig(spare_blocks_ratio=1.5)
    with pytest.raises(ValueError, match="npu_queue_limit"):
        SchedulerConfig(npu_queue_limit=0)
    assert MinimalBucketConfig(256).buckets(128, 256) == ([Bucket.prefill(1, 128)], [Bucket.decode(1, 256)])
    assert Bucket.decode(4, 128).kv_cache_size == 127 and Bucket.prefill(2, 64).is_prefill
