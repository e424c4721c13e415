"""From a loaded transformers model to a running engine: capture → passes → pipelines →
backend executables → paged KV cache → scheduler → engine.

This is the only module of ``fxcompiler`` that imports ``backends`` and ``runtime``
(through the façade), keeping the lower layers free of upward imports.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from .capture import CapturedProgram
from .config import SchedulerConfig
from .pipeline import Bucket, ParamFileInfo, Pipeline
from .pipeline_builder import BuildResult, build_pipelines

log = logging.getLogger("fxcompiler.build")

DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass
class KvCachePlan:
    num_blocks: int
    block_size: int
    max_seqs: int
    max_blocks_per_seq: int
    bytes: int


def plan_kv_cache(captured: CapturedProgram, *, block_size: int, max_context: int, max_decode_batch: int,
                  max_processing_samples: int, num_blocks: int | None, memory_bytes: int | None) -> KvCachePlan:
    """Size the paged cache: ``num_blocks`` if given, else what fits ``memory_bytes`` (default 1 GiB),
    never more than the largest decode batch at full context needs."""
    from runtime.block_manager import PagedKVCache

    g = captured.geometry
    per_block = PagedKVCache.bytes_per_block(g.num_layers, block_size, g.num_kv_heads, g.head_dim, g.dtype)
    max_blocks_per_seq = -(-max_context // block_size)
    if num_blocks is None:
        budget = DEFAULT_KV_CACHE_BYTES if memory_bytes is None else memory_bytes
        num_blocks = min(budget // per_block, max_decode_batch * max_blocks_per_seq) + 1
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory_bytes={budget} holds no KV block of {per_block} bytes")
    elif num_blocks < 2:
        raise ValueError(f"paged_attention_num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
    max_seqs = max(1, min(max_processing_samples, num_blocks - 1, 4096))
    return KvCachePlan(int(num_blocks), block_size, max_seqs, max_blocks_per_seq, int(num_blocks * per_block))


def save_params(params: dict[str, torch.Tensor], path: str | os.PathLike, fmt: str) -> ParamFileInfo:
    """Write the pipeline parameters (tied tensors stored once per name, contiguous)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tensors = {k: v.detach().contiguous().clone() if _shares_storage(v, params, k) else v.detach().contiguous()
               for k, v in params.items()}
    tmp = path + ".tmp"
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, tmp)
    elif fmt == "pt":
        torch.save(tensors, tmp)
    else:
        raise ValueError(f"param_saved_format must be 'safetensors' or 'pt', got {fmt!r}")
    os.replace(tmp, path)
    return ParamFileInfo(path, fmt)


def _shares_storage(t: torch.Tensor, params: dict[str, torch.Tensor], name: str) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(k != name and v.untyped_storage().data_ptr() == ptr for k, v in params.items())


def pass_services(device: torch.device) -> dict[str, Any]:
    """Backend objects the passes read from ``ctx.options`` (passes may not import backends):
    on CPU, the ``kernel_tuner`` that ``lower_cpu_kernels`` asks whether ``fxc::linear`` wins
    (nothing is built or measured unless that pass runs)."""
    if device.type != "cpu":
        return {}
    from backends.cpu.autotune import LinearAutotuner

    return {"kernel_tuner": LinearAutotuner()}


def build(captured: CapturedProgram, model_name: str, buckets: list[Bucket], *, block_size: int,
          device: torch.device, kind: str, options: dict[str, Any], param_file_path=None,
          param_saved_format="safetensors") -> BuildResult:
    """Build one pipeline per bucket from a captured program (params optionally written to a file).

    The pipelines take ownership of ``captured.params``: drop every other reference to the
    model first, so that passes which re-lay weights out free the originals as they go.
    """
    t0 = time.perf_counter()
    result = build_pipelines(captured, buckets, model_name, kind=kind, device=str(device), block_size=block_size,
                             options=options, services=pass_services(device))
    captured.geometry = result.context.geometry  # passes may change it (auto_bfloat16_cast: a bf16 KV cache)
    if param_file_path is not None:
        info = save_params(result.params, param_file_path, param_saved_format)
        for p in result.pipelines:
            p.param_files = {k: info for k in p.param_files}
    log.info("build: %.1fs", time.perf_counter() - t0)
    return result


def start_engine(captured: CapturedProgram, result: BuildResult, *, prefill_buckets: list[Bucket],
                 decode_buckets: list[Bucket], scheduler_config: SchedulerConfig, kv: KvCachePlan,
                 device: torch.device, tokenizer, eos_token_ids: frozenset[int], max_context: int):
    from backends import get_backend
    from runtime.block_manager import BlockManager, PagedKVCache
    from runtime.engine import Engine
    from runtime.model_runner import ModelRunner
    from runtime.scheduler import Scheduler

    by_bucket: dict[Bucket, Pipeline] = {p.bucket: p for p in result.pipelines}
    compiled: dict[str, Any] = {}
    executables = {}
    for bucket, pipe in by_bucket.items():
        blob_ids = tuple(sorted(pipe.blobs))
        key = ",".join(blob_ids)
        if key not in compiled:
            compiled[key] = get_backend("fx", device.type)(pipe, result.params, device)
        executables[bucket] = compiled[key]
    g = captured.geometry
    cache = PagedKVCache(g.num_layers, kv.num_blocks, kv.block_size, g.num_kv_heads, g.head_dim, g.dtype, device)
    blocks = BlockManager(kv.num_blocks, kv.block_size, kv.max_seqs, kv.max_blocks_per_seq)
    scheduler = Scheduler(scheduler_config, blocks, prefill_buckets, decode_buckets)

    class _Executables(dict):
        """Falls back to the shared executable for buckets made up at run time (recompute)."""

        def __missing__(self, bucket):
            return next(iter(compiled.values()))

    runner = ModelRunner(_Executables(executables), cache, blocks, device)
    return Engine(runner, scheduler, tokenizer, eos_token_ids, max_context)
