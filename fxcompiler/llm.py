"""``fxcompiler.LLM``: furiosa_llm.LLM's interface over the capture → passes → pipelines → runtime stack."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import queue
import logging
import os
import threading
import uuid
import warnings
import weakref
from pathlib import Path
from typing import Any, AsyncGenerator, Dict, List, Literal, Mapping, Sequence

import torch

from .config import (BucketConfig, DefaultBucketConfig, KvCacheSharingAcrossBeamsConfig, LLMBackend, LLMConfig,
                     ManualBucketConfig, MinimalBucketConfig, SchedulerConfig, chunk_buckets,
                     resolve_prefill_chunk_size)
from .models.loader import load_tokenizer, parse_dtype
from .models.sources import resolve_model_source
from . import lifecycle
from .chat_checks import check_messages, check_tools
from .outputs import RequestOutput
from .cache_limits import default_cache_dir
from .pipeline import Bucket, Device, parse_devices
from .sampling_params import RequestOutputKind, SamplingParams
from runtime import openmp_team

log = logging.getLogger("fxcompiler")


CACHE_DIR = default_cache_dir()


def _step_and_dispatch_of(llm_ref: "weakref.ref[LLM]") -> None:
    """``LLM._step_and_dispatch`` through a weak reference: a stream waiter thread that has not yet
    dropped its finished task must not keep a dropped LLM (and its engine) alive."""
    llm = llm_ref()
    if llm is not None:
        llm._step_and_dispatch()


def _later(capability: str, issue: str) -> NotImplementedError:
    return NotImplementedError(f"{capability} is not implemented yet ({issue}); see the README's feature table")


class LLM:
    """An LLM for generating texts from prompts and sampling parameters (furiosa_llm.LLM-compatible).

    See the README's compatibility table for the parameters whose default or meaning
    differs on CPU/GPU, and for the ones that raise ``NotImplementedError`` until the
    capability lands.
    """

    def __init__(
        self,
        model: str,
        task_type: str | None = None,
        llm_config: LLMConfig | None = None,
        auto_bfloat16_cast: bool | None = None,
        qformat_path: os.PathLike | None = None,
        qparam_path: os.PathLike | None = None,
        quant_ckpt_file_path: os.PathLike | None = None,
        hf_overrides: Dict[str, Any] = {},  # noqa: B006 - furiosa's signature
        bucket_config: BucketConfig | None = None,
        speculative_model: "str | LLM | None" = None,
        speculative_model_llm_config: LLMConfig | None = None,
        speculative_model_qformat_path: os.PathLike | None = None,
        speculative_model_qparam_path: os.PathLike | None = None,
        speculative_model_quant_ckpt_file_path: os.PathLike | None = None,
        speculative_model_config: Dict[str, Any] = {},  # noqa: B006
        speculative_model_bucket_config: BucketConfig | None = None,
        speculative_draft_tensor_parallel_size: int | None = None,
        speculative_draft_pipeline_parallel_size: int | None = None,
        speculative_draft_data_parallel_size: int | None = None,
        speculative_draft_num_blocks_per_pp_stage: Sequence[int] | None = None,
        num_speculative_tokens: int | None = None,
        max_seq_len_to_capture: int = 2048,
        max_prompt_len: int | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int | None = None,
        tokenizer: Any = None,
        tokenizer_mode: Literal["auto", "slow"] = "auto",
        trust_remote_code: bool = False,
        seed: int | None = None,
        devices: str | Sequence[Device] | None = None,
        param_file_path: os.PathLike | None = None,
        param_saved_format: Literal["safetensors", "pt"] = "safetensors",
        do_decompositions_for_model_rewrite: bool = False,
        comp_supertask_kind: Literal["edf", "dfg", "fx"] | None = None,
        cache_dir: os.PathLike | None = CACHE_DIR,
        backend: LLMBackend | None = None,
        use_blockwise_compile: bool = True,
        num_blocks_per_supertask: int = 1,
        num_blocks_per_pp_stage: Sequence[int] | None = None,
        embed_all_constants_into_graph: bool = False,
        paged_attention_block_size: int = 16,
        kv_cache_sharing_across_beams_config: KvCacheSharingAcrossBeamsConfig | None = None,
        prefill_chunk_size: int | None = None,
        scheduler_config: SchedulerConfig = SchedulerConfig(),  # noqa: B008 - furiosa's signature
        packing_type: Literal["IDENTITY"] = "IDENTITY",
        compiler_config_overrides: Mapping | None = None,
        use_random_weight: bool = False,
        num_pipeline_builder_workers: int = 1,
        num_compile_workers: int = 1,
        skip_engine: bool = False,
        artifacts_export_path: str | os.PathLike | None = None,
        *,
        _cleanup: bool = True,
        _pipelines_with_metadata: Sequence | None = None,
        _custom_buckets: Sequence[Bucket] = [],  # noqa: B006
        _optimize_logit_shape: bool = True,
        _model_metadata: Any = None,
        _unpadded_vocab_size: int | None = None,
        _embedding_layer_as_single_block: bool = False,
        _artifact_id: str = "NO_ARTIFACT_ID",
        **kwargs,
    ):
        llm_kwargs = {k: v for k, v in locals().items() if k not in ("self", "kwargs", "__class__")}
        llm_kwargs.update(kwargs)  # a tensor-parallel LLM starts its rank workers with the same arguments
        # -- vLLM-style extras and furiosa's hidden kwargs -------------------------------------------
        mppp = kwargs.pop("_mppp", None)  # set inside a rank worker: {"plan", "rank", "group"}
        self._mppp = mppp
        paged_attention_num_blocks = kwargs.pop("paged_attention_num_blocks", None)
        kv_cache_memory_bytes = kwargs.pop("kv_cache_memory_bytes", None)
        dtype = parse_dtype(kwargs.pop("dtype", "auto"))
        enable_chunked_prefill = kwargs.pop("enable_chunked_prefill", None)
        max_num_batched_tokens = kwargs.pop("max_num_batched_tokens", None)
        enable_prefix_caching = kwargs.pop("enable_prefix_caching", True)  # vLLM's name; on by default
        keep_gguf_quantization = kwargs.pop("keep_gguf_quantization", False)  # docs/quantization.md
        compile_in_subprocess = kwargs.pop("compile_in_subprocess", False)  # fxcompiler/build_isolation.py
        override_pooler_config = kwargs.pop("override_pooler_config", None)  # embedding models (docs/encoder-tasks.md)
        quantize_lm_head = kwargs.pop("quantize_lm_head", None)  # None: a kept GGUF's output on its own blocks
        quantization_group_size = kwargs.pop("quantization_group_size", None)
        from .kv_cache_quant import parse_kv_cache_dtype

        kv_cache_dtype = parse_kv_cache_dtype(kwargs.pop("kv_cache_dtype", "auto"))  # docs/quantization.md KV8
        kv_cache_scales = kwargs.pop("kv_cache_scales", None)
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
        if not isinstance(compile_in_subprocess, bool):
            raise TypeError(f"compile_in_subprocess must be a bool, got {compile_in_subprocess!r}")
        for hidden in ("optimize_paged_attention_block_loading", "sparse_select_version", "one_supertask_per_device"):
            kwargs.pop(hidden, None)
        if "config" in kwargs:
            if hf_overrides:
                raise ValueError("pass either hf_overrides or its deprecated alias config, not both")
            hf_overrides = kwargs.pop("config")
        if kwargs:
            raise TypeError(f"LLM() got unexpected keyword arguments: {sorted(kwargs)}")

        # -- argument validation (every error names its argument) --------------------------------
        from .encoder_tasks import ENCODER_TASKS, resolve_task

        self.task = resolve_task(task_type, model)  # None: inferred from the checkpoint's class, as furiosa does
        if override_pooler_config is not None and self.task not in ENCODER_TASKS:
            raise ValueError("override_pooler_config is for embedding models (task_type='embed')")
        if tokenizer_mode not in ("auto", "slow"):
            raise ValueError(f"tokenizer_mode must be 'auto' or 'slow', got {tokenizer_mode!r}")
        if not isinstance(hf_overrides, dict):
            raise TypeError(f"hf_overrides must be a dict, got {type(hf_overrides).__name__}")
        if packing_type != "IDENTITY":
            raise ValueError(f"packing_type must be 'IDENTITY', got {packing_type!r}")
        if param_saved_format not in ("safetensors", "pt"):
            raise ValueError(f"param_saved_format must be 'safetensors' or 'pt', got {param_saved_format!r}")
        for name, value in (("max_seq_len_to_capture", max_seq_len_to_capture),
                            ("paged_attention_block_size", paged_attention_block_size),
                            ("num_pipeline_builder_workers", num_pipeline_builder_workers),
                            ("num_compile_workers", num_compile_workers),
                            ("num_blocks_per_supertask", num_blocks_per_supertask),
                            ("tensor_parallel_size", tensor_parallel_size),
                            ("pipeline_parallel_size", pipeline_parallel_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_prompt_len is not None and (not isinstance(max_prompt_len, int) or max_prompt_len < 1):
            raise ValueError(f"max_prompt_len must be a positive int, got {max_prompt_len!r}")
        if paged_attention_num_blocks is not None and (not isinstance(paged_attention_num_blocks, int)
                                                       or paged_attention_num_blocks < 2):
            raise ValueError(f"paged_attention_num_blocks must be an int >= 2, got {paged_attention_num_blocks!r}")
        if kv_cache_memory_bytes is not None and (isinstance(kv_cache_memory_bytes, bool)
                                                  or not isinstance(kv_cache_memory_bytes, int)
                                                  or kv_cache_memory_bytes < 1):
            raise ValueError(f"kv_cache_memory_bytes must be a positive int (bytes, e.g. 1 << 30), "
                             f"got {kv_cache_memory_bytes!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32):
            raise ValueError(f"seed must be an int in [0, 2**32) or None, got {seed!r}")
        if not isinstance(scheduler_config, SchedulerConfig):
            raise TypeError(f"scheduler_config must be a SchedulerConfig, got {type(scheduler_config).__name__}")
        if bucket_config is not None and not isinstance(bucket_config, BucketConfig):
            raise TypeError(f"bucket_config must be a BucketConfig (ManualBucketConfig, MinimalBucketConfig or DefaultBucketConfig), "
                            f"got {type(bucket_config).__name__}")
        if not isinstance(use_blockwise_compile, bool):
            raise TypeError(f"use_blockwise_compile must be a bool, got {use_blockwise_compile!r}")
        if artifacts_export_path is not None and not isinstance(artifacts_export_path, (str, os.PathLike)):
            raise TypeError(f"artifacts_export_path must be a str or os.PathLike, got {type(artifacts_export_path).__name__}")
        self.backend = LLMBackend.parse(backend)
        if self.backend not in (LLMBackend.TORCH_PIPELINE_RUNNER, LLMBackend.MOCK_BACKEND_V2):
            raise ValueError(f"backend={self.backend.name} needs a Furiosa NPU; use TORCH_PIPELINE_RUNNER "
                             "(or MOCK_BACKEND_V2, its alias on CPU/GPU)")
        self.devices = parse_devices(devices)
        if comp_supertask_kind not in (None, "fx", "dfg", "edf"):
            raise ValueError(f"comp_supertask_kind must be 'fx', 'dfg' or 'edf', got {comp_supertask_kind!r}")
        if self.task in ENCODER_TASKS:  # question answering, embeddings, scoring: fxcompiler/encoder_llm.py
            from .encoder_llm import init_encoder

            self._device = self.devices[0].to_torch_device()
            if self._device.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"devices={devices!r}: CUDA is not available on this machine")
            init_encoder(self, self.task, llm_kwargs)
            return

        # -- capabilities of later issues ------------------------------------------------------------
        from .quant_options import directory_quantization_files, quantization_options, resolve_quant_checkpoint

        if qformat_path is None and qparam_path is None:  # a directory written by `fxcompiler quantize`
            qformat_path, qparam_path = directory_quantization_files(model)
        quant_args = dict(quantization_config=llm_config.quantization_config if llm_config is not None else None,
                          qformat_path=qformat_path, qparam_path=qparam_path, quant_ckpt_file_path=quant_ckpt_file_path,
                          keep_gguf_quantization=keep_gguf_quantization, quantize_lm_head=quantize_lm_head,
                          group_size=quantization_group_size)
        quantization_options(**quant_args, check_source=False)  # validate before loading anything
        model, quant_args = resolve_quant_checkpoint(model, quant_args, cache_dir)  # compressed-tensors/GPTQ/AWQ
        from .speculative import parse_request

        spec_request = parse_request(
            speculative_model, num_speculative_tokens,
            dict(devices=devices, tp=tensor_parallel_size, pp=pipeline_parallel_size, dp=data_parallel_size),
            speculative_model_llm_config=speculative_model_llm_config,
            speculative_model_qformat_path=speculative_model_qformat_path,
            speculative_model_qparam_path=speculative_model_qparam_path,
            speculative_model_quant_ckpt_file_path=speculative_model_quant_ckpt_file_path,
            speculative_model_config=speculative_model_config or None,
            speculative_model_bucket_config=speculative_model_bucket_config,
            speculative_draft_tensor_parallel_size=speculative_draft_tensor_parallel_size,
            speculative_draft_pipeline_parallel_size=speculative_draft_pipeline_parallel_size,
            speculative_draft_data_parallel_size=speculative_draft_data_parallel_size,
            speculative_draft_num_blocks_per_pp_stage=speculative_draft_num_blocks_per_pp_stage)
        if spec_request is not None and kv_cache_sharing_across_beams_config is not None:
            raise ValueError("speculative_model cannot be combined with kv_cache_sharing_across_beams_config: that "
                             "engine serves beam search only, and beam search runs without speculation")
        from .quant_config import QDtype
        from .quant_options import quantized_kv_dtype

        kv_quant = quantized_kv_dtype(quant_args["quantization_config"], quant_args["qformat_path"])
        given_kv = getattr(quant_args["quantization_config"], "kv_cache", None)
        quant_kv = {QDtype.INT8: "int8", QDtype.FP8: "fp8"}  # KV dtypes of a config -> kv_cache_dtype
        if given_kv is not None and given_kv not in quant_kv and kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} conflicts with llm_config.quantization_config="
                             f"{quant_args['quantization_config']} (a {given_kv.value} KV cache); use a KV8 / KVf8 "
                             "scheme there (e.g. W8A16KV8, W4A16KVf8) or leave kv_cache_dtype unset")
        if kv_quant in quant_kv and kv_cache_dtype not in ("auto", quant_kv[kv_quant]):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} conflicts with the quantization's {kv_quant.value} KV "
                             "cache (llm_config.quantization_config or the qformat's --kv_dtype)")
        if kv_cache_scales is not None and kv_cache_dtype == "auto" and kv_quant not in quant_kv:
            raise ValueError("kv_cache_scales is given only with kv_cache_dtype='int8' or 'fp8'")
        if given_kv is not None and given_kv not in quant_kv:
            pass  # llm_config names a float KV cache: a kv_cache_scales.json beside the model is not used
        elif kv_cache_dtype == "auto" and qformat_path is not None and kv_cache_scales is None:
            from .kv_cache_quant import KV_SCALES_FILE, load_kv_scales

            scales_file = Path(os.fspath(qformat_path)).parent / KV_SCALES_FILE
            if scales_file.is_file():  # written by `fxcompiler quantize --scheme ...+kv8 / +kvf8`
                kv_cache_dtype, kv_cache_scales = load_kv_scales(scales_file)["kv_cache_dtype"], scales_file
        elif kv_cache_dtype == "auto" and kv_cache_scales is None and Path(os.fspath(model)).is_dir():
            from .kv_cache_quant import KV_SCALES_FILE, load_kv_scales

            scales_file = Path(os.fspath(model)) / KV_SCALES_FILE
            if scales_file.is_file():
                kv_cache_dtype, kv_cache_scales = load_kv_scales(scales_file)["kv_cache_dtype"], scales_file
        if kv_quant in quant_kv:  # W8A16KV8, w_i8_a_i8_kv_i8, W4A16KVf8, --kv_dtype int8 / fp8: that cache (scales
            if kv_cache_dtype not in ("auto", quant_kv[kv_quant]):  # from kv_cache_scales / a kv_cache_scales.json,
                raise ValueError(f"the quantization's {kv_quant.value} KV cache conflicts with the "  # else calibrated)
                                 f"{kv_cache_dtype} scales of {os.fspath(kv_cache_scales)!r}")
            kv_cache_dtype = quant_kv[kv_quant]
        if kv_cache_dtype != "auto":
            from .multihost import torchrun_env

            if kv_cache_scales is None and (mppp is not None or tensor_parallel_size * pipeline_parallel_size > 1
                                            or torchrun_env() is not None):
                raise NotImplementedError(
                    f"kv_cache_dtype={kv_cache_dtype!r} with tensor/pipeline parallelism (or torchrun ranks) needs "
                    "kv_cache_scales: the built-in calibration runs a one-process engine. Calibrate once with "
                    "fxcompiler.kv_cache_quant.quantize_kv_cache on a one-process LLM (or `fxcompiler quantize "
                    "--scheme ...+kv8 / +kvf8`) and pass kv_cache_scales= (or a kv_cache_scales.json beside the model)")
            if artifacts_export_path is not None and speculative_model is not None:
                raise NotImplementedError(f"exporting an artifact of a kv_cache_dtype={kv_cache_dtype!r} target with a "
                                          "draft is not wired")
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_cache_scales = None
        from .parallel_llm import resolve_plan

        self.parallel_plan = None if mppp is not None else resolve_plan(
            tensor_parallel_size, pipeline_parallel_size, data_parallel_size, self.devices, num_blocks_per_pp_stage)
        self._workers = None
        if spec_request is not None and self.parallel_plan is not None and self.parallel_plan.tp * self.parallel_plan.pp > 1:
            if artifacts_export_path is not None:
                raise _later("exporting an artifact of a tensor/pipeline-parallel target with its draft",
                             "speculative-decoding issue")
        if kv_cache_sharing_across_beams_config is not None and not isinstance(
                kv_cache_sharing_across_beams_config, KvCacheSharingAcrossBeamsConfig):
            raise TypeError("kv_cache_sharing_across_beams_config must be a KvCacheSharingAcrossBeamsConfig, got "
                            f"{type(kv_cache_sharing_across_beams_config).__name__}")
        self.prefill_chunk_size = resolve_prefill_chunk_size(
            prefill_chunk_size, scheduler_config.prefill_chunk_size, enable_chunked_prefill, max_num_batched_tokens)
        if num_compile_workers > 1 and comp_supertask_kind == "edf":
            from .edf import check_spawn_safe

            check_spawn_safe()  # not while a compile worker re-imports an unguarded main script
        custom = [getattr(b, "bucket", b) for b in _custom_buckets]  # Bucket or BucketWithOutputLogitsSize
        if not all(isinstance(b, Bucket) for b in custom):
            raise TypeError("_custom_buckets must hold Bucket objects")

        if seed is not None:
            from transformers import set_seed

            set_seed(seed)
        self.seed = seed
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        if self.cache_dir is not None:
            from .integrity import check_private_dir

            check_private_dir(self.cache_dir)  # created 0700; refused when another user could write to it
            from .cache_limits import max_size

            max_size()  # a bad FXCOMPILER_CACHE_MAX_SIZE is refused now, not after a build stored its entry
        self.comp_supertask_kind = comp_supertask_kind or "fx"
        self.use_blockwise_compile = use_blockwise_compile
        self.scheduler_config = scheduler_config
        self.artifact_id = _artifact_id
        self.is_generative_model = True
        self._device = self.devices[0].to_torch_device()
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"devices={devices!r}: CUDA is not available on this machine")

        # -- model, tokenizer ------------------------------------------------------------------------
        source = resolve_model_source(model)
        from .models.info_cache import load_model_and_tokenizer

        loaded, self.tokenizer = load_model_and_tokenizer(  # transformers-free when cached (models/info_cache.py)
            source, cache_dir=self.cache_dir, hf_overrides=hf_overrides, trust_remote_code=trust_remote_code,
            tokenizer=tokenizer, tokenizer_mode=tokenizer_mode)
        self.model_id = source.model_id
        self.model_config = loaded.config
        self.generation_config = loaded.generation_config

        max_pos = getattr(loaded.config, "max_position_embeddings", None) or getattr(loaded.config, "n_positions", None)
        if max_pos is not None and max_seq_len_to_capture > max_pos:
            raise ValueError(f"max_seq_len_to_capture={max_seq_len_to_capture} exceeds the model's "
                             f"max_position_embeddings={max_pos}")

        # -- buckets -------------------------------------------------------------------------------
        prompt_cap = max_prompt_len or max_seq_len_to_capture
        if prompt_cap > max_seq_len_to_capture:
            raise ValueError(f"max_prompt_len={max_prompt_len} exceeds max_seq_len_to_capture={max_seq_len_to_capture}")
        policy = bucket_config or DefaultBucketConfig(max_decode_batch=min(256, scheduler_config.max_processing_samples))
        prefill, decode = policy.buckets(prompt_cap, max_seq_len_to_capture)
        prefill += [b for b in custom if b.is_prefill and b not in prefill]  # furiosa's hidden extra buckets
        decode += [b for b in custom if b.kv_cache_size == b.attention_size - 1 and b not in decode]
        if kv_cache_sharing_across_beams_config is not None:  # decode buckets hold batch x beam_width rows
            width = kv_cache_sharing_across_beams_config.beam_width
            decode = list(dict.fromkeys(Bucket.decode(b.batch_size * width, b.attention_size) for b in decode))
        if not prefill:
            if not skip_engine:
                raise ValueError("bucket_config has no prefill buckets (allowed only with skip_engine=True)")
        largest_decode = max(b.attention_size for b in decode)
        if max_pos is not None and largest_decode > max_pos:
            raise ValueError(f"decode bucket attention size {largest_decode} exceeds the model's "
                             f"max_position_embeddings={max_pos}")
        if largest_decode != max_seq_len_to_capture:
            warnings.warn(f"max_seq_len_to_capture={max_seq_len_to_capture} differs from the largest decode bucket "
                          f"({largest_decode}); using {largest_decode}")
        self.max_seq_len_to_capture = largest_decode
        if spec_request is not None:
            from .speculative import check_before_build

            check_before_build(self, spec_request)
        largest_prefill = max((b.attention_size for b in prefill), default=0)
        if max_prompt_len is not None and max_prompt_len > largest_prefill:
            raise ValueError(f"max_prompt_len={max_prompt_len} is larger than the largest prefill bucket "
                             f"({largest_prefill}); the buckets cannot cover it")
        self.prompt_max_seq_len = min(max_prompt_len or largest_prefill, largest_prefill, largest_decode)
        self.buckets = prefill + decode + [b for b in custom if b not in prefill and b not in decode]
        if self.prefill_chunk_size is not None:  # furiosa's batch-1 chunk buckets (kv = (i-1)*chunk)
            self.buckets += [b for b in chunk_buckets(self.prefill_chunk_size, self.prompt_max_seq_len)
                             if b not in self.buckets]

        # -- build ---------------------------------------------------------------------------------
        from .build import ProgramRequest, build, compile_program, plan_kv_cache

        from .multihost import torchrun_env

        if self.parallel_plan is not None and (self.parallel_plan.tp * self.parallel_plan.pp > 1
                                               or torchrun_env() is not None):
            # the ranks build their shards; this process schedules (data-parallel replicas: one group each,
            # or under torchrun the job's ranks, dp x pp x tp of them)
            rank_kwargs = {k: v for k, v in llm_kwargs.items()  # the draft and its speculator live in this process
                           if not k.startswith("speculative_") and k != "num_speculative_tokens"}
            if kv_cache_dtype != "auto":  # KV8 / KVf8: the model's scales, checked here; each rank slices its share
                from .kv_cache_quant import check_kv_scales

                c = loaded.config
                self.kv_cache_scales = check_kv_scales(
                    kv_cache_scales, int(c.num_hidden_layers),
                    int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads))
                rank_kwargs.update(kv_cache_dtype=kv_cache_dtype,
                                   kv_cache_scales=tuple(t.tolist() for t in self.kv_cache_scales))
            self._start_parallel(rank_kwargs, loaded.config, prefill, decode, paged_attention_block_size,
                                 enable_prefix_caching, skip_engine, artifacts_export_path,
                                 kv_cache_sharing_across_beams_config)
            self.speculative_llm, self.num_speculative_tokens = None, None
            if spec_request is not None:  # verify steps run in the ranks through the engine's runner
                from .speculative import attach

                try:
                    attach(self, spec_request)
                except BaseException:
                    self.shutdown()
                    raise
            return
        options = dict(compiler_config_overrides or {})
        if mppp is not None:
            options["mppp"] = mppp
        quant_opts, quant_bf16 = quantization_options(**quant_args, model_config=loaded.config,
                                                      gguf_path=source.path if source.is_gguf else None)
        if quant_opts is not None:
            options["quantization"] = quant_opts
        self.quantization = None if quant_opts is None else {  # recorded in artifacts (fxcompiler inspect)
            **{k: v for k, v in quant_opts.items() if k != "gguf"},
            **({"gguf_sha256": quant_opts["gguf"]["sha256"]} if "gguf" in quant_opts else {})}
        auto_bfloat16_cast = auto_bfloat16_cast or quant_bf16  # W16A16 / W8A16 / W4A16: bf16 activations
        from .pass_manager import passes_spec_as_json

        self._passes_override = passes_spec_as_json(options.get("passes"))  # recorded in artifacts
        if auto_bfloat16_cast:  # captured in the checkpoint's dtype; the auto_bfloat16_cast pass makes it bf16
            options["auto_bfloat16_cast"] = True
        if embed_all_constants_into_graph:
            options["embed_all_constants_into_graph"] = True
        if do_decompositions_for_model_rewrite:
            options["do_decompositions_for_model_rewrite"] = True
        request = ProgramRequest(source.kind, self.model_id, loaded.model_dir, dict(hf_overrides), dtype,
                                 use_random_weight, seed, trust_remote_code, paged_attention_block_size, options)
        build_options = {**options, "use_blockwise_compile": use_blockwise_compile,
                         "num_blocks_per_supertask": num_blocks_per_supertask}
        fx_build = dict(model_name=self.model_id, buckets=self.buckets, block_size=paged_attention_block_size,
                        options=build_options, workers=num_pipeline_builder_workers)
        gm, ctx, self.build_info = compile_program(request, loaded, device=self._device, cache_dir=self.cache_dir,
                                                   in_subprocess=compile_in_subprocess, fx_build=fx_build)
        self.geometry = ctx.geometry  # passes may change it (auto_bfloat16_cast: a bf16 KV cache)
        self.num_blocks_per_supertask = num_blocks_per_supertask
        self._build = build(
            (gm, ctx), self.model_id, self.buckets, block_size=paged_attention_block_size, device=self._device,
            kind=self.comp_supertask_kind, options=build_options, param_file_path=param_file_path,
            param_saved_format=param_saved_format, cache_dir=self.cache_dir,
            program_key=self.build_info.get("cache_key"), num_compile_workers=num_compile_workers,
            num_pipeline_builder_workers=num_pipeline_builder_workers)
        self.build_info["build_cache"] = self._build.build_cache
        self.pipelines = self._build.pipelines
        self.pipelines_with_meta = [(p, {"output_logits_size": 1}) for p in self.pipelines]
        plan_args = dict(block_size=paged_attention_block_size, max_context=self.max_seq_len_to_capture,
                         max_decode_batch=max(b.batch_size for b in decode),
                         max_processing_samples=scheduler_config.max_processing_samples,
                         num_blocks=paged_attention_num_blocks, memory_bytes=kv_cache_memory_bytes)
        self.kv_cache_plan = plan_kv_cache(self.geometry, **plan_args)
        self._eos = self._eos_token_ids()
        self._prefill_buckets, self._decode_buckets = prefill, decode
        self.paged_attention_block_size = paged_attention_block_size
        if kv_cache_dtype != "auto":
            from .kv_cache_quant import KV_TORCH_DTYPES, check_kv_scales

            if kv_cache_scales is None:  # the documented default: calibrate on the built-in pydoc_data sample
                if skip_engine:
                    raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} with skip_engine=True needs kv_cache_scales "
                                     "(the built-in calibration runs the engine)")
                self.kv_cache_scales = self._calibrate_kv_cache(enable_prefix_caching)
            else:
                g = self.geometry
                if mppp is not None:  # a rank: the model's scales, sliced to its stage's layers and its KV heads
                    from .parallel_llm import rank_kv_scales

                    kv_cache_scales = rank_kv_scales(kv_cache_scales, loaded.config, mppp)
                self.kv_cache_scales = check_kv_scales(kv_cache_scales, g.num_layers, g.num_kv_heads)
            self.kv_cache_plan = plan_kv_cache(self.geometry, **plan_args, kv_dtype=KV_TORCH_DTYPES[kv_cache_dtype])
        if artifacts_export_path is not None and spec_request is None:
            self._export_artifact(artifacts_export_path, param_saved_format)
        self._start(skip_engine, enable_prefix_caching, kv_cache_sharing_across_beams_config)
        self._mark_mapped_cache_entries()
        self.speculative_llm, self.num_speculative_tokens = None, None
        if spec_request is not None:
            from .speculative import attach

            attach(self, spec_request)
            if artifacts_export_path is not None:  # with the draft under speculative_model/
                try:
                    self._export_artifact(artifacts_export_path, param_saved_format)
                except BaseException:
                    self.shutdown()
                    raise

    def _start_parallel(self, llm_kwargs, config, prefill, decode, block_size, enable_prefix_caching, skip_engine,
                        artifacts_export_path, beams_config) -> None:
        """Tensor parallelism: spawn the rank workers (fxcompiler/parallel_llm.py), then the engine here."""
        from .parallel_llm import check_model, logits_rank, start_parallel_engine, start_rank_workers

        if skip_engine:
            raise NotImplementedError("skip_engine with a tensor/pipeline-parallel plan: the ranks build their "
                                      "shards with their engines (artifacts_export_path writes each rank's shard)")
        if artifacts_export_path is not None:  # each rank exports its shard to <path>/rank<r>
            from .parallel_artifacts import prepare_export

            prepare_export(artifacts_export_path, self.parallel_plan)
        check_model(self.parallel_plan, config)
        from runtime.workers import WorkerGroups

        replica_plan = dataclasses.replace(self.parallel_plan, dp=1)
        self._workers = WorkerGroups()  # reaped by shutdown()
        readies, steps = [], []
        from .multihost import start_torchrun, torchrun_env

        try:
            if torchrun_env() is not None:  # several hosts: this is rank 0 (the others serve inside LLM())
                peers, readies, steps = start_torchrun(self.parallel_plan, llm_kwargs)  # a step per replica
                self._workers.append(peers)
            for _ in range(self.parallel_plan.dp if not steps else 0):
                group, ready = start_rank_workers(replica_plan, llm_kwargs)
                self._workers.append(group)
                readies.append(ready)
        except BaseException:
            self._workers.shutdown()
            raise
        ready = readies[0]
        from .build import KvCachePlan

        self.kv_cache_plan = KvCachePlan(**ready["kv"])
        self.geometry = ready["geometry"]
        self.parallel_plan.placements = dict(ready["placements"]["placements"])
        self.parallel_stages = ready["placements"]["stages"]  # pipeline stages: their [start, stop) blocks
        self.build_info = {**ready["build_info"], "parallel_plan": self.parallel_plan.to_dict(), "comm": ready["comm"]}
        self._rank_pass_history = ready["pass_history"]
        if artifacts_export_path is not None:
            from .parallel_artifacts import write_plan

            write_plan(artifacts_export_path, self.parallel_plan)
        self._build = None
        self.pipelines, self.pipelines_with_meta = [], []
        self.num_blocks_per_supertask = llm_kwargs.get("num_blocks_per_supertask", 1)
        self._eos = self._eos_token_ids()
        self._prefill_buckets, self._decode_buckets = prefill, decode
        self.paged_attention_block_size = block_size
        engines = [start_parallel_engine(
            group, logits_rank=logits_rank(self.parallel_plan), micro_batches=self.parallel_plan.pp, kv=KvCachePlan(**r["kv"]), prefill_buckets=prefill,
            decode_buckets=decode, scheduler_config=self.scheduler_config, tokenizer=self.tokenizer,
            eos_token_ids=self._eos, max_context=self.max_seq_len_to_capture)
            for group, r in zip(steps or self._workers.groups, readies)]
        self.engine = self._route(engines)
        self.engine.configure(enable_prefix_caching=enable_prefix_caching, prefill_chunk_size=self.prefill_chunk_size,
                              kv_cache_sharing_across_beams=beams_config)
        self._start_driver()

    def _export_artifact(self, path, param_saved_format: str = "safetensors", speculative: bool = True):
        from .artifacts import ArtifactContents, export_artifact
        from .speculative_artifacts import export_hook

        settings = {
            "block_size": self.paged_attention_block_size, "max_seq_len_to_capture": self.max_seq_len_to_capture,
            "prompt_max_seq_len": self.prompt_max_seq_len, "prefill_chunk_size": self.prefill_chunk_size,
            "prefill_buckets": [[b.batch_size, b.attention_size, b.kv_cache_size] for b in self._prefill_buckets],
            "decode_buckets": [[b.batch_size, b.attention_size, b.kv_cache_size] for b in self._decode_buckets],
            "comp_supertask_kind": self.comp_supertask_kind, "use_blockwise_compile": self.use_blockwise_compile,
            "num_blocks_per_supertask": self.num_blocks_per_supertask,
            "eos_token_ids": sorted(self._eos), "compile_cache_key": self.build_info.get("cache_key"),
            "quantization": getattr(self, "quantization", None),
            "passes_override": getattr(self, "_passes_override", None),
        }
        if self.__dict__.get("kv_cache_scales") is not None:  # KV8 / KVf8: the static scales travel with the artifact
            k, v = self.kv_cache_scales
            settings["kv_cache"] = {"dtype": self.kv_cache_dtype, "k_scale": k.tolist(), "v_scale": v.tolist()}
        from .parallel_artifacts import plan_settings

        settings.update(plan_settings(self.__dict__.get("_mppp")))  # the parallel plan (a rank's shard: its rank)
        passes = [dict(h) for h in self.pass_history]  # records are JSON (PassManager enforces it)
        contents = ArtifactContents(self.model_id, self.model_config, self.generation_config, self.tokenizer,
                                    self.pipelines, self._build.params, self.geometry, settings, passes,
                                    source_graphs=getattr(self._build, "source_graphs", {}))
        return export_artifact(contents, path, param_saved_format=param_saved_format,
                               extra=export_hook(self, param_saved_format) if speculative else None)

    def _calibrate_kv_cache(self, enable_prefix_caching: bool):
        """KV8 / KVf8 scales from the built-in calibration sample, with a float-cache engine started for it."""
        from .kv_cache_quant import quantize_kv_cache

        self._start(False, enable_prefix_caching, None, replicas=1)  # data-parallel replicas: one calibrates
        try:
            return quantize_kv_cache(self, kv_dtype=self.kv_cache_dtype)
        finally:  # the float engine goes; _start then builds the int8 one
            self._driver.close()
            self._driver, self.engine = None, None

    def _kv_torch_dtype(self):
        """The cache tensors' dtype: int8 / float8_e4m3fn once scales are set, else None (the model's)."""
        if self.__dict__.get("kv_cache_scales") is None:
            return None
        from .kv_cache_quant import KV_TORCH_DTYPES

        return KV_TORCH_DTYPES[self.kv_cache_dtype]

    def _mark_mapped_cache_entries(self) -> None:
        """Mark the cache entries whose files this process maps (the C++ kernel libraries, which ``backends/``
        loads from ``$FXCOMPILER_CACHE_DIR/kernels`` and whose loads touch nothing, mapped parameters) as used,
        for the cache size limit's recency (fxcompiler/cache_limits.py)."""
        from .cache_limits import touch_mapped

        touch_mapped([self.cache_dir, default_cache_dir()])  # the kernels live in the process-wide default

    def _start(self, skip_engine: bool, enable_prefix_caching: bool, kv_cache_sharing_across_beams_config,
               replicas: int | None = None) -> None:
        """Start the engine over the built pipelines (unless ``skip_engine``) and its driver thread: one per
        data-parallel replica (in-process replicas share the pipelines), or ``replicas`` of them."""
        from .build import start_engine

        self.engine = None
        if not skip_engine:
            plan = self.__dict__.get("parallel_plan")
            self.engine = self._route([start_engine(
                self.geometry, self._build, prefill_buckets=self._prefill_buckets,
                decode_buckets=self._decode_buckets, scheduler_config=self.scheduler_config, kv=self.kv_cache_plan,
                device=self._device, tokenizer=self.tokenizer, eos_token_ids=self._eos,
                max_context=self.max_seq_len_to_capture, kv_scales=self.__dict__.get("kv_cache_scales"),
                kv_dtype=self._kv_torch_dtype())
                for _ in range(replicas or (plan.dp if plan is not None else 1))])
            self.engine.configure(enable_prefix_caching=enable_prefix_caching,
                                  prefill_chunk_size=self.prefill_chunk_size,
                                  kv_cache_sharing_across_beams=kv_cache_sharing_across_beams_config)
        self._start_driver()

    @staticmethod
    def _route(engines: list):
        """One engine, or data-parallel replicas behind a least-loaded router (runtime/router.py)."""
        if len(engines) == 1:
            return engines[0]
        from runtime.router import ReplicaRouter

        return ReplicaRouter(engines)

    def _start_driver(self) -> None:
        """The engine's driver thread and request bookkeeping; registers the LLM for shutdown at exit."""
        self._lock = threading.Lock()
        self._pending: dict[str, list[RequestOutput]] = {}
        self._live: set[str] = set()  # request ids whose outputs a caller waits for (others are dropped)
        if self.engine is not None:
            from runtime.driver import EngineDriver

            self._driver = EngineDriver(self.engine, self.scheduler_config.npu_queue_limit, self._lock)
            lifecycle.register(self)
        openmp_team.release()  # the build's team: the steps may run on another thread (runtime.openmp_team)

    # -- lifecycle ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine's worker thread, abort what is running and release the engine (its KV
        cache and executables). Idempotent; the LLM cannot generate afterwards. Also called by
        ``with LLM(...) as llm:``, when the LLM is garbage-collected, and at interpreter exit."""
        lifecycle.shutdown(self)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            lifecycle.shutdown(self, finalizing=True)
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    # -- helpers -------------------------------------------------------------------------------------
    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (getattr(self.generation_config, "eos_token_id", None),
                    getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(x) for x in src)
        return frozenset(ids)

    def _require_engine(self):
        if not self.__dict__.get("is_generative_model", True):
            raise ValueError(f"generate / chat / stream_generate need a text-generation model; this LLM's task is "
                             f"{self.task!r} (use LLM.bert_forward, LLM.embed or LLM.score)")
        if getattr(self, "_shut_down", False):
            raise RuntimeError("this LLM was shut down (LLM.shutdown()); create a new LLM to generate")
        if self.engine is None:
            raise RuntimeError("this LLM was built with skip_engine=True; it has no engine to generate with")
        return self.engine

    def _encode(self, prompts: list[str], prompt_token_ids, tokenizer_kwargs) -> list[list[int]]:
        if prompt_token_ids is not None:
            ids = prompt_token_ids["input_ids"] if hasattr(prompt_token_ids, "keys") else prompt_token_ids
            if isinstance(ids, torch.Tensor) or hasattr(ids, "tolist"):
                ids = ids.tolist()
            if ids and isinstance(ids, (list, tuple)) and not isinstance(ids[0], (list, tuple)):
                ids = [ids]
            mask = prompt_token_ids.get("attention_mask") if hasattr(prompt_token_ids, "get") else None
            if mask is not None:
                mask = mask.tolist() if isinstance(mask, torch.Tensor) else mask
                ids = [[t for t, m in zip(row, mrow) if m] for row, mrow in zip(ids, mask)]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(row, (list, tuple)) for row in ids):
                raise TypeError("prompt_token_ids must be a list of ints or a list of lists of ints")
            from runtime.admission import check_token_ids

            checked = []
            for i, row in enumerate(ids):
                try:
                    checked.append(check_token_ids(row, getattr(self.geometry, "vocab_size", None)))
                except (TypeError, ValueError) as exc:
                    raise type(exc)(f"prompt_token_ids row {i}: {exc}") from None
            ids = checked
            if prompts and len(prompts) != len(ids):
                raise ValueError(f"prompt_token_ids has {len(ids)} sequences but {len(prompts)} prompts were given")
            return ids
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids (or tokenizer=...)")
        kw = dict(tokenizer_kwargs or {})
        return [list(self.tokenizer(p, **kw)["input_ids"]) for p in prompts]

    def _prepare(self, prompts, sampling_params, prompt_token_ids, tokenizer_kwargs):
        single = isinstance(prompts, str)
        if prompts is None and prompt_token_ids is not None:
            prompts_list: list[str | None] = []
        elif single:
            prompts_list = [prompts]
        elif isinstance(prompts, (list, tuple)):
            if not prompts:
                raise ValueError("prompts must not be an empty list")
            if not all(isinstance(p, str) for p in prompts):
                raise TypeError("prompts must be a str or a list of str")
            prompts_list = list(prompts)
        else:
            raise TypeError(f"prompts must be a str or a list of str, got {type(prompts).__name__}")
        if tokenizer_kwargs is not None and not isinstance(tokenizer_kwargs, dict):
            raise TypeError("tokenizer_kwargs must be a dict")
        ids = self._encode(prompts_list, prompt_token_ids, tokenizer_kwargs)
        if not prompts_list:
            prompts_list = [None] * len(ids)
            single = len(ids) == 1 and not isinstance(prompt_token_ids, list)
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(ids)
        elif isinstance(sampling_params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in sampling_params):
            if len(sampling_params) != len(ids):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(ids)} prompts")
            params = list(sampling_params)
        else:
            raise TypeError("sampling_params must be a SamplingParams or a list of them")
        finals = []
        for i, (row, p) in enumerate(zip(ids, params)):
            if not row:
                raise ValueError(f"prompts[{i}] is empty after tokenization")
            p = p.clone()
            p.verify_and_finalize_max_tokens(len(row), self.prompt_max_seq_len, self.max_seq_len_to_capture)
            if self.engine is not None:
                self.engine.check_params(p)  # kv_cache_sharing_across_beams_config rules
            finals.append(p)
        return single, prompts_list, ids, finals

    def _step_and_dispatch(self, inline: bool = False) -> None:
        """Wait (briefly) for the next engine step's outputs and file them by request id.

        The engine runs on the driver's worker thread, at most ``npu_queue_limit`` steps
        ahead of the callers consuming its outputs. ``inline=True`` (blocking ``generate``)
        runs the step on the calling thread instead while the worker is idle: torch's
        OpenMP teams belong to the thread that starts a parallel region, and handing
        the work between threads made batch-1 decode ~30 % slower (measured)."""
        driver, engine = self.__dict__.get("_driver"), self.__dict__.get("engine")
        if self.__dict__.get("_shut_down") or driver is None or engine is None:
            raise RuntimeError("this LLM was shut down (LLM.shutdown()) while a request was running")
        if inline and not driver.running:
            with self._lock:
                outs = engine.step() if engine.has_unfinished_requests() else None
            if outs is not None:
                for out in outs:
                    if out.request_id in self._live:
                        self._pending.setdefault(out.request_id, []).append(out)
                return
            # nothing left to step: outputs a worker produced earlier may still wait in its queue
        driver.kick()
        try:
            outs = driver.next_outputs(timeout=0.05)
        except queue.Empty:
            return
        for out in outs or ():
            if out.request_id in self._live:  # a cancelled request's late outputs are dropped
                self._pending.setdefault(out.request_id, []).append(out)

    # -- public API ------------------------------------------------------------------------------
    def generate(self, prompts: str | List[str], sampling_params: SamplingParams = SamplingParams(),  # noqa: B008
                 prompt_token_ids=None, tokenizer_kwargs: Dict[str, Any] | None = None
                 ) -> RequestOutput | List[RequestOutput]:
        """Generate completions; a str prompt gives one RequestOutput, a list gives a list in order."""
        engine = self._require_engine()
        single, prompts_list, ids, params = self._prepare(prompts, sampling_params, prompt_token_ids,
                                                          tokenizer_kwargs)
        request_ids = []
        results: dict[str, RequestOutput] = {}
        try:
            for prompt, row, p in zip(prompts_list, ids, params):
                p.output_kind = RequestOutputKind.FINAL_ONLY
                rid = uuid.uuid4().hex
                self._live.add(rid)
                request_ids.append(rid)
                with self._lock:
                    engine.add_request(rid, row, p, prompt)
            while len(results) < len(request_ids):
                for rid in request_ids:
                    for out in self._pending.pop(rid, ()):
                        if out.error is not None:
                            raise out.error
                        if out.finished:
                            results[rid] = out
                if len(results) < len(request_ids):
                    self._step_and_dispatch(inline=True)
        except BaseException:
            with self._lock:
                for rid in request_ids:
                    if rid not in results:
                        engine.abort_request(rid)
            raise
        finally:
            for rid in request_ids:
                self._live.discard(rid)
                self._pending.pop(rid, None)
            openmp_team.release()  # the team of the inline steps: a stream's worker may step next
        outputs = [results[r] for r in request_ids]
        return outputs[0] if single else outputs

    def embed(self, prompts, pooling_params=None):
        """vLLM's pooled embeddings of an embedding model (``task_type='embed'``): a list of
        ``EmbeddingRequestOutput`` (``.outputs.embedding``); see docs/encoder-tasks.md."""
        from .encoder_llm import embed

        return embed(self, prompts, pooling_params)

    def score(self, text_1, text_2):
        """vLLM's scores of (text_1, text_2) pairs: a cross-encoder's relevance (``task_type='score'``) or the
        cosine similarity of an embedding model's vectors; a list of ``ScoringRequestOutput`` (``.outputs.score``)."""
        from .encoder_llm import score

        return score(self, text_1, text_2)

    def classify(self, prompts):
        """vLLM's class probabilities of a ``*ForSequenceClassification`` checkpoint (``task_type='score'``): a list
        of ``ClassificationRequestOutput`` (``.outputs.probs``); see docs/encoder-tasks.md."""
        from .encoder_llm import classify

        return classify(self, prompts)

    def bert_forward(self, prompts, contexts, *, max_answer_len: int = 30):
        """furiosa's BERT question answering (``task_type='question-answering'``): one ``RequestOutput`` per
        (question, context) pair whose completion is the answer span (``.answer``: span and start/end logits)."""
        from .encoder_llm import bert_forward

        return bert_forward(self, prompts, contexts, max_answer_len)

    def chat(self, messages, sampling_params: SamplingParams = SamplingParams(),  # noqa: B008
             chat_template: str | None = None, chat_template_content_format: Literal["string"] = "string",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: List[Dict[str, Any]] | None = None) -> List[RequestOutput]:
        """Render conversations with the chat template and generate a reply for each."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be True")
        if chat_template_content_format != "string":
            raise ValueError(f"chat_template_content_format must be 'string', got {chat_template_content_format!r}")
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer; this model has none")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty conversation or list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        rendered = []
        check_tools(tools)
        for i, conv in enumerate(conversations):
            if not conv or not all(isinstance(m, dict) and "role" in m for m in conv):
                raise ValueError(f"conversation {i} must be a non-empty list of {{'role', 'content'}} dicts")
            check_messages(conv, i)
            text = self.tokenizer.apply_chat_template(
                list(conv), tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template, tools=tools)
            if continue_final_message and self.tokenizer.eos_token and text.rstrip().endswith(self.tokenizer.eos_token):
                text = text.rstrip()[: -len(self.tokenizer.eos_token)]
            rendered.append(text)
        return self.generate(rendered, sampling_params, tokenizer_kwargs={"add_special_tokens": False})

    async def stream_generate(self, prompt: str, sampling_params: SamplingParams = SamplingParams(),  # noqa: B008
                              prompt_token_ids=None, tokenizer_kwargs: Dict[str, Any] | None = None,
                              is_demo: bool = False) -> AsyncGenerator[str, None]:
        """Yield text deltas of one prompt as they are generated (UTF-8 safe)."""
        engine = self._require_engine()
        if not isinstance(prompt, str):
            raise ValueError("stream_generate takes a single prompt string")
        _, prompts_list, ids, params = self._prepare(prompt, sampling_params, prompt_token_ids, tokenizer_kwargs)
        if is_demo and len(ids[0]) > 1024:
            raise ValueError(f"demo prompts are limited to 1024 tokens, got {len(ids[0])}")
        p = params[0]
        if p.best_of > p.n:
            raise ValueError(f"stream_generate: best_of ({p.best_of}) must equal n ({p.n}): the best completions "
                             "are known only at the end (use generate)")
        p.output_kind = RequestOutputKind.DELTA
        rid = uuid.uuid4().hex
        self._live.add(rid)
        try:
            with self._lock:
                engine.add_request(rid, ids[0], p, prompt)
        except BaseException:
            self._live.discard(rid)
            raise
        loop = asyncio.get_running_loop()
        from runtime.worker_threads import stream_waiters

        waiters = stream_waiters()  # process-wide threads, not the loop's own (new per asyncio.run)
        step = functools.partial(_step_and_dispatch_of, weakref.ref(self))
        done = False
        # n > 1: every completion is yielded, one after another: completion i streams live once
        # completions < i have finished; the deltas of later ones wait in `held` until then.
        held: dict[int, list[str]] = {}
        ended: set[int] = set()
        current = 0
        try:
            while not done:
                pending = self._pending.pop(rid, [])
                if not pending:
                    await loop.run_in_executor(waiters, step)
                    continue
                for out in pending:
                    if out.error is not None:
                        done = True  # failed: nothing left to abort
                        raise out.error
                    for c in out.outputs:
                        if c.text:
                            held.setdefault(c.index, []).append(c.text)
                        if c.finish_reason is not None:
                            ended.add(c.index)
                    done = done or out.finished
                    while True:
                        for delta in held.pop(current, ()):
                            yield delta
                        if current not in ended and not done:
                            break
                        if not held or current >= max(held):
                            break
                        current += 1
        finally:
            self._live.discard(rid)
            if not done and not getattr(self, "_shut_down", False):
                with self._lock:
                    engine.abort_request(rid)
            self._pending.pop(rid, None)

    @classmethod
    def from_engine_args(cls, engine_args) -> "LLM":
        """Build (or load, for an artifact directory) the LLM a :class:`fxcompiler.engine_args.EngineArgs` describes."""
        return engine_args.create_llm()

    # -- artifacts ---------------------------------------------------------------------------------
    @classmethod
    def load_artifact(cls, model_id_or_path, *, revision=None, devices=None, data_parallel_size=None,
                      pipeline_parallel_size=None, num_blocks_per_pp_stage=None, bucket_config=None,
                      scheduler_config=None, speculative_model=None, speculative_draft_data_parallel_size=None,
                      speculative_draft_pipeline_parallel_size=None, speculative_draft_num_blocks_per_pp_stage=None,
                      skip_speculative_model_load=False, tokenizer=None, tokenizer_mode="auto", seed=None,
                      cache_dir=CACHE_DIR, skip_engine=False, **kwargs) -> "LLM":
        """Load an artifact directory written by ``LLM(..., artifacts_export_path=...)`` or
        ``fxcompiler build``: no export, no passes, no checkpoint; ``bucket_config`` may select
        a subset of the built buckets. A draft the artifact carries (``speculative_model/``, or
        the n-gram proposer it records) is attached unless ``skip_speculative_model_load``;
        ``speculative_model`` (an ``LLM``, an artifact path or ``"[ngram]"``) overrides it
        (docs/speculative.md)."""
        if revision is not None:
            raise ValueError(f"revision={revision!r}: artifacts are loaded from local directories only "
                             "(nothing is downloaded from a hub)")
        if not isinstance(skip_speculative_model_load, bool):
            raise TypeError("skip_speculative_model_load must be a bool")
        from .speculative_artifacts import plan_load

        draft = plan_load(  # the artifact's draft (speculative_model/), or the one given; docs/speculative.md
            model_id_or_path, speculative_model=speculative_model, enabled=not skip_speculative_model_load,
            num_speculative_tokens=kwargs.pop("num_speculative_tokens", None),
            bucket_config=kwargs.pop("speculative_model_bucket_config", None),
            paged_attention_num_blocks=kwargs.pop("speculative_model_paged_attention_num_blocks", None),
            draft_parallel=dict(speculative_draft_data_parallel_size=speculative_draft_data_parallel_size,
                                speculative_draft_pipeline_parallel_size=speculative_draft_pipeline_parallel_size,
                                speculative_draft_num_blocks_per_pp_stage=speculative_draft_num_blocks_per_pp_stage))
        return cls._load_artifact_dir(
            model_id_or_path, devices=devices, data_parallel_size=data_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size, num_blocks_per_pp_stage=num_blocks_per_pp_stage,
            bucket_config=bucket_config, scheduler_config=scheduler_config, tokenizer=tokenizer,
            tokenizer_mode=tokenizer_mode, seed=seed, cache_dir=cache_dir, skip_engine=skip_engine,
            _speculative=draft, **kwargs)

    @classmethod
    def load_artifacts(cls, path, **kwargs) -> "LLM":
        warnings.warn("LLM.load_artifacts is deprecated; use LLM.load_artifact", DeprecationWarning, stacklevel=2)
        return cls.load_artifact(path, **kwargs)

    @classmethod
    def from_artifacts(cls, path, bucket_config=None, speculative_model=None, num_speculative_tokens=None,
                       speculative_model_bucket_config=None, use_speculative_decoding_if_possible=True,
                       data_parallel_size=None, pipeline_parallel_size=None, num_blocks_per_pp_stage=None,
                       tokenizer=None, tokenizer_mode="auto", seed=None, devices=None, cache_dir=CACHE_DIR,
                       backend=None, paged_attention_num_blocks=None, scheduler_config=None,
                       packing_type="IDENTITY", skip_engine=False, *, _cleanup=True, **kwargs) -> "LLM":
        """furiosa's older loader of the same artifact directory (see :meth:`load_artifact`;
        ``use_speculative_decoding_if_possible=False`` loads it without its draft)."""
        if packing_type != "IDENTITY":
            raise ValueError(f"packing_type must be 'IDENTITY', got {packing_type!r}")
        if not isinstance(use_speculative_decoding_if_possible, bool):
            raise TypeError("use_speculative_decoding_if_possible must be a bool")
        from .speculative_artifacts import plan_load

        draft = plan_load(
            path, speculative_model=speculative_model, num_speculative_tokens=num_speculative_tokens,
            enabled=use_speculative_decoding_if_possible, opt_out="use_speculative_decoding_if_possible=False",
            bucket_config=speculative_model_bucket_config,
            paged_attention_num_blocks=kwargs.pop("speculative_model_paged_attention_num_blocks", None))
        return cls._load_artifact_dir(
            path, devices=devices, data_parallel_size=data_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
            num_blocks_per_pp_stage=num_blocks_per_pp_stage, bucket_config=bucket_config,
            scheduler_config=scheduler_config, tokenizer=tokenizer, tokenizer_mode=tokenizer_mode, seed=seed,
            cache_dir=cache_dir, skip_engine=skip_engine, backend=backend,
            paged_attention_num_blocks=paged_attention_num_blocks, _speculative=draft, **kwargs)

    @classmethod
    def _load_artifact_dir(cls, path, *, devices, data_parallel_size, pipeline_parallel_size, num_blocks_per_pp_stage,
                           bucket_config, scheduler_config, tokenizer, tokenizer_mode, seed, cache_dir, skip_engine,
                           backend=None, paged_attention_num_blocks=None, **kwargs) -> "LLM":
        import time

        from .artifacts import ArtifactError, read_artifact, read_manifest
        from .build import plan_kv_cache
        from .pass_manager import CompileContext
        from .pipeline_builder import BuildResult

        t0 = time.perf_counter()
        kv_cache_memory_bytes = kwargs.pop("kv_cache_memory_bytes", None)
        paged_attention_num_blocks = kwargs.pop("paged_attention_num_blocks", paged_attention_num_blocks)
        enable_prefix_caching = kwargs.pop("enable_prefix_caching", True)
        from .kv_cache_quant import parse_kv_cache_dtype

        kv_cache_dtype = kwargs.pop("kv_cache_dtype", None)  # None: as the artifact was built
        kv_cache_dtype = None if kv_cache_dtype is None else parse_kv_cache_dtype(kv_cache_dtype)
        rank_of_plan = kwargs.pop("_rank_of_plan", False)  # a rank worker loading its shard
        tensor_parallel_size = kwargs.pop("tensor_parallel_size", None)
        draft = kwargs.pop("_speculative", None)  # a speculative_artifacts.DraftLoad
        trusted_hashes = kwargs.pop("_trusted_hashes", None)  # a draft inside an artifact: the digest it lists
        if kwargs:
            raise TypeError(f"unexpected keyword arguments for loading an artifact: {sorted(kwargs)}")
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
        if paged_attention_num_blocks is not None and (not isinstance(paged_attention_num_blocks, int)
                                                       or isinstance(paged_attention_num_blocks, bool)
                                                       or paged_attention_num_blocks < 2):
            raise ValueError(f"paged_attention_num_blocks must be an int >= 2, got {paged_attention_num_blocks!r}")
        if tokenizer_mode not in ("auto", "slow"):
            raise ValueError(f"tokenizer_mode must be 'auto' or 'slow', got {tokenizer_mode!r}")
        scheduler_config = SchedulerConfig() if scheduler_config is None else scheduler_config
        if not isinstance(scheduler_config, SchedulerConfig):
            raise TypeError(f"scheduler_config must be a SchedulerConfig, got {type(scheduler_config).__name__}")
        if bucket_config is not None and not isinstance(bucket_config, BucketConfig):
            raise TypeError(f"bucket_config must be a BucketConfig (ManualBucketConfig, MinimalBucketConfig or DefaultBucketConfig), "
                            f"got {type(bucket_config).__name__}")
        from .parallel_artifacts import check_plan, load_parallel

        plan = check_plan(path, tensor_parallel_size=tensor_parallel_size,
                          pipeline_parallel_size=pipeline_parallel_size, data_parallel_size=data_parallel_size,
                          num_blocks_per_pp_stage=num_blocks_per_pp_stage, devices=parse_devices(devices),
                          rank_of_plan=rank_of_plan)
        if draft is not None and plan is not None and plan.tp * plan.pp > 1:
            from .speculative_artifacts import refuse_parallel_target

            raise refuse_parallel_target()
        if plan is not None and plan.tp * plan.pp > 1:  # rank workers load their shards
            return load_parallel(cls, path, plan, bucket_config=bucket_config, scheduler_config=scheduler_config,
                                 tokenizer=tokenizer, tokenizer_mode=tokenizer_mode, seed=seed, cache_dir=cache_dir,
                                 kv_cache_memory_bytes=kv_cache_memory_bytes,
                                 paged_attention_num_blocks=paged_attention_num_blocks,
                                 enable_prefix_caching=enable_prefix_caching)
        obj = cls.__new__(cls)
        obj.parallel_plan = plan  # None, or data-parallel replicas of a one-process artifact
        obj.devices = parse_devices(devices)[:1]
        obj._device = obj.devices[0].to_torch_device()
        if obj._device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"devices={devices!r}: CUDA is not available on this machine")
        obj.backend = LLMBackend.parse(backend)
        if obj.backend not in (LLMBackend.TORCH_PIPELINE_RUNNER, LLMBackend.MOCK_BACKEND_V2):
            raise ValueError(f"backend={obj.backend.name} needs a Furiosa NPU; use TORCH_PIPELINE_RUNNER")
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"artifact path must be a str or os.PathLike, got {type(path).__name__}")
        manifest = read_manifest(path)
        st = manifest["settings"]
        built_prefill = [Bucket(*b) for b in st["prefill_buckets"]]
        built_decode = [Bucket(*b) for b in st["decode_buckets"]]
        built_all = [Bucket(*b) for b in manifest["buckets"]["all"]]
        if bucket_config is None:
            prefill, decode = built_prefill, built_decode
        else:
            prefill, decode = bucket_config.buckets(st["prompt_max_seq_len"], st["max_seq_len_to_capture"])
            missing = [b for b in prefill + decode if b not in built_all]
            if missing:
                raise ArtifactError(
                    "bucket_config selects buckets this artifact was not built with: "
                    f"{[(b.phase, b.batch_size, b.attention_size) for b in missing]}; built prefill buckets "
                    f"(batch, attention): {[(b.batch_size, b.attention_size) for b in built_prefill]}, "
                    f"decode: {[(b.batch_size, b.attention_size) for b in built_decode]}")
        if not decode or (not prefill and not skip_engine):
            raise ValueError("bucket_config must keep at least one prefill and one decode bucket")
        extra = [b for b in built_all if b not in built_prefill and b not in built_decode]  # chunk buckets
        buckets = list(dict.fromkeys(prefill + decode + extra))
        contents = read_artifact(path, buckets=buckets, cache_dir=cache_dir, trusted_hashes=trusted_hashes)

        if seed is not None:
            from transformers import set_seed

            set_seed(seed)
        obj.seed = seed
        obj.cache_dir = Path(cache_dir) if cache_dir is not None else None
        obj.model_id = contents.model_id
        obj._lazy_model_dir = contents.model_dir  # configs load on first access (transformers' imports cost ~2 s)
        obj.tokenizer = load_tokenizer(contents.model_dir, tokenizer, tokenizer_mode)
        obj.comp_supertask_kind = st.get("comp_supertask_kind", "fx")
        obj.use_blockwise_compile = st.get("use_blockwise_compile", True)
        obj.num_blocks_per_supertask = st.get("num_blocks_per_supertask", 1)
        obj.scheduler_config = scheduler_config
        obj.artifact_id = manifest["files"]["artifact.json"]["sha256"] if "artifact.json" in manifest["files"] \
            else manifest.get("created", "NO_ARTIFACT_ID")
        obj.is_generative_model = True
        obj.prefill_chunk_size = st.get("prefill_chunk_size")
        obj.max_seq_len_to_capture = max(b.attention_size for b in decode)
        obj.prompt_max_seq_len = min(st["prompt_max_seq_len"], max((b.attention_size for b in prefill), default=0)
                                     or st["prompt_max_seq_len"], obj.max_seq_len_to_capture)
        obj.buckets = buckets
        obj.geometry = contents.geometry
        obj.paged_attention_block_size = st["block_size"]
        context = CompileContext([], contents.params, contents.geometry, history=contents.passes)
        obj._build = BuildResult(contents.pipelines, None, context)
        obj.pipelines = contents.pipelines
        obj.pipelines_with_meta = [(p, {"output_logits_size": 1}) for p in obj.pipelines]
        kv8 = st.get("kv_cache")  # KV8 / KVf8 artifacts carry their static scales
        obj.kv_cache_scales, obj.kv_cache_dtype = None, "auto"
        built_kv = None if kv8 is None else kv8.get("dtype", "int8")
        if kv_cache_dtype not in (None, "auto") and kv_cache_dtype != built_kv:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: the artifact {os.fspath(path)!r} was built "
                             + ("without KV cache scales" if kv8 is None else f"with {built_kv} KV cache scales")
                             + f" (build it with kv_cache_dtype={kv_cache_dtype!r})")
        if kv8 is not None and kv_cache_dtype != "auto":
            from .kv_cache_quant import KV_TORCH_DTYPES, check_kv_scales

            if built_kv not in KV_TORCH_DTYPES:
                raise ValueError(f"artifact settings.kv_cache.dtype must be 'int8' or 'fp8', got {built_kv!r}")
            obj.kv_cache_scales = check_kv_scales(kv8, obj.geometry.num_layers, obj.geometry.num_kv_heads,
                                                  "artifact settings.kv_cache")
            obj.kv_cache_dtype = built_kv
        obj.kv_cache_plan = plan_kv_cache(
            obj.geometry, block_size=st["block_size"], max_context=obj.max_seq_len_to_capture,
            max_decode_batch=max(b.batch_size for b in decode),
            max_processing_samples=scheduler_config.max_processing_samples,
            num_blocks=paged_attention_num_blocks, memory_bytes=kv_cache_memory_bytes,
            kv_dtype=obj._kv_torch_dtype())
        obj._eos = frozenset(st["eos_token_ids"]) if "eos_token_ids" in st else obj._eos_token_ids()
        obj._prefill_buckets, obj._decode_buckets = prefill, decode
        obj.build_info = {"compile_cache": "artifact", "artifact": os.fspath(path), "export_seconds": 0.0}
        obj.speculative_llm, obj.num_speculative_tokens = None, None
        spec_request = None if draft is None else draft.request(
            cls, obj, Path(path), contents.manifest, devices=devices, cache_dir=cache_dir,
            scheduler_config=scheduler_config, tokenizer_mode=tokenizer_mode)  # loaded and checked before the engine
        obj._start(skip_engine, enable_prefix_caching, None)
        if spec_request is not None:
            from .speculative import attach

            try:
                attach(obj, spec_request)
            except BaseException:
                obj.shutdown()
                raise
        obj.build_info["seconds"] = time.perf_counter() - t0
        return obj

    # -- configs (loaded lazily for artifacts) ------------------------------------------------------
    @property
    def model_config(self):
        """The transformers config of the model (hf_overrides applied)."""
        if "_model_config" not in self.__dict__:
            from transformers import AutoConfig

            self._model_config = AutoConfig.from_pretrained(str(self._lazy_model_dir), local_files_only=True)
        return self._model_config

    @model_config.setter
    def model_config(self, value) -> None:
        self._model_config = value

    @property
    def generation_config(self):
        """The model's generation config (None if it has none)."""
        if "_generation_config" not in self.__dict__:
            from transformers import GenerationConfig

            try:
                self._generation_config = GenerationConfig.from_pretrained(str(self._lazy_model_dir),
                                                                           local_files_only=True)
            except (OSError, ValueError):
                self._generation_config = None
        return self._generation_config

    @generation_config.setter
    def generation_config(self, value) -> None:
        self._generation_config = value

    # -- introspection -----------------------------------------------------------------------------
    def _get_splitted_gms(self) -> dict[str, list[torch.fx.GraphModule]]:
        """The fx GraphModules of every pipeline (testing hook, as in furiosa)."""
        return {p.name: [p.blobs[t.data_blob].graph for _, t in p.compute_supertasks()] for p in self.pipelines}

    @property
    def pass_history(self) -> list[dict]:
        if self._build is None:  # tensor parallel: rank 0's passes
            return list(self._rank_pass_history)
        return list(self._build.context.history)

    def __repr__(self) -> str:
        if not self.__dict__.get("is_generative_model", True):
            from .encoder_llm import describe

            return describe(self)
        return (f"LLM(model={self.model_id!r}, device={self._device}, buckets={len(self.buckets)}, "
                f"kv_blocks={self.kv_cache_plan.num_blocks}x{self.kv_cache_plan.block_size})")


__all__ = ["LLM", "ManualBucketConfig", "MinimalBucketConfig"]
