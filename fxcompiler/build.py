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

from .build_cache import ensure_meta
from .capture import ModelGeometry
from .config import SchedulerConfig
from .pass_manager import CompileContext
from .pipeline import Bucket, ParamFileInfo, Pipeline
from .pipeline_builder import BuildResult, build_pipelines, optimise

log = logging.getLogger("fxcompiler.build")

DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass
class KvCachePlan:
    num_blocks: int
    block_size: int
    max_seqs: int
    max_blocks_per_seq: int
    bytes: int


def plan_kv_cache(geometry: ModelGeometry, *, block_size: int, max_context: int, max_decode_batch: int,
                  max_processing_samples: int, num_blocks: int | None, memory_bytes: int | None,
                  kv_dtype: torch.dtype | None = None) -> KvCachePlan:
    """Size the paged cache: ``num_blocks`` if given, else what fits ``memory_bytes`` (default 1 GiB),
    never more than the largest decode batch at full context needs. ``kv_dtype`` (default: the model's;
    ``torch.int8`` for KV8, ``torch.float8_e4m3fn`` for KVf8) sets the element size, so an int8 or fp8 cache gets
    4x (fp32) / 2x (bf16) the blocks."""
    from runtime.block_manager import PagedKVCache

    g = geometry
    per_block = PagedKVCache.bytes_per_block(g.num_layers, block_size, g.num_kv_heads, g.head_dim,
                                             kv_dtype or g.dtype)
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


def backend_fingerprint(device: torch.device) -> dict[str, Any]:
    """What about the device changes the optimised graph (the lowering pass asks the CPU
    backend which kernels exist and win): part of the compile-cache key. On CPU that includes the
    intra-op thread count the autotuner times with: at 1 thread ATen's matmul and the kernel tie
    on SmolLM2's q/k/v and o_proj shapes at M = 1-64, at 2 threads the kernel wins by 1.3x at M = 16-64,
    so a program lowered in a 1-thread process is the wrong one for a 2-thread engine."""
    if device.type != "cpu":
        return {"device": str(device)}
    from backends.cpu import _build

    paths = {k: os.environ[k] for k in ("FXCOMPILER_CPU_AMX", "FXCOMPILER_CPU_BF16DOT") if k in os.environ}
    return {"device": "cpu", "isa": _build.detect_isa(), "cpu": _cpu_model(), "threads": torch.get_num_threads(),
            **({"paths": paths} if paths else {})}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


@dataclass
class ProgramRequest:
    """Everything that determines the optimised program of a model (the compile-cache key inputs)."""

    source_kind: str
    model_id: str
    model_dir: Any  # pathlib.Path of the HF-format directory
    hf_overrides: dict[str, Any]
    dtype: torch.dtype | None
    use_random_weight: bool
    seed: int | None
    trust_remote_code: bool
    block_size: int
    options: dict[str, Any]

    def _model_inputs(self) -> dict[str, Any]:
        """The key inputs that identify the model itself (both keys below hash them)."""
        from .compile_cache import model_files_identity

        files = model_files_identity(self.model_dir)
        if self.use_random_weight:  # weights come from the seed, not the files
            files = [f for f in files if f[0].endswith(".json")]
        return dict(model_id=self.model_id, source=self.source_kind, files=files, overrides=self.hf_overrides,
                    dtype=str(self.dtype), random=self.use_random_weight,
                    seed=self.seed if self.use_random_weight else None, block_size=self.block_size)

    def cache_key(self, device: torch.device) -> str | None:
        from .compile_cache import options_fingerprint, program_key

        opts = options_fingerprint(self.options)
        if opts is None or self.trust_remote_code:
            return None
        return program_key(**self._model_inputs(), options=opts, backend=backend_fingerprint(device))

    def capture_key(self, device: torch.device) -> str | None:
        """Key of the exported program before any pass (:mod:`fxcompiler.capture_cache`): the model and the
        capture settings, not the compiler options; None where the model cannot be fingerprinted."""
        from .compile_cache import program_key

        if self.trust_remote_code or self.model_dir is None:
            return None
        return program_key(stage="capture", **self._model_inputs(), device=torch.device(device).type)


def compile_program(request: ProgramRequest, loaded, *, device: torch.device, cache_dir=None,
                    instruments=None, in_subprocess: bool = False, fx_build: dict[str, Any] | None = None
                    ) -> tuple[torch.fx.GraphModule, CompileContext, dict[str, Any]]:
    """The optimised program of ``loaded`` (a :class:`~fxcompiler.models.loader.LoadedModel`
    without weights yet): from the compile cache when ``cache_dir`` holds it, else by
    instantiating the model, exporting it and running the passes (then cached); with ``in_subprocess``,
    a miss the cache can hold is built by a child process (:mod:`fxcompiler.build_isolation`; with ``fx_build``
    the bucket pipelines too) and loaded.
    Returns ``(graph, context, info)``; info says ``compile_cache`` hit/miss/off and timings."""
    from .compile_cache import CompileCache

    t0 = time.perf_counter()
    if device.type == "cpu":
        from backends.cpu import prebuild

        prebuild.start()  # the C++ extensions build in the background, in parallel, while the model is exported
    enabled = os.environ.get("FXCOMPILER_COMPILE_CACHE", "1").strip().lower() not in ("0", "off", "false", "no")
    key = request.cache_key(device) if enabled and cache_dir is not None and instruments is None else None
    cache = CompileCache(cache_dir) if key is not None else None
    if cache is not None:
        child_info = None
        hit = cache.load(key, restore_meta=False, lazy_graph=True)  # build() traces and restores meta if it builds
        if hit is None and in_subprocess:
            from .build_isolation import compile_in_child

            child_info = compile_in_child(request, loaded, device=device, cache_dir=cache_dir, key=key,
                                          fx_build=fx_build)
            if child_info is not None:
                hit = cache.load(key, restore_meta=False, lazy_graph=True)
        if hit is not None:
            gm, ctx = hit
            ctx.options = {**request.options, **pass_services(device)}
            for h in ctx.history:  # the passes did not run in this build: their time is the stored build's
                h["cached_seconds"], h["seconds"], h["cache_hit"] = h.get("seconds", 0.0), 0.0, True
            if child_info is not None:  # a miss, built by the child
                return gm, ctx, {"compile_cache": "miss", "compiled_in": "subprocess", "cache_key": key,
                                 "export_seconds": child_info.get("export_seconds", 0.0),
                                 "seconds": time.perf_counter() - t0}
            return gm, ctx, {"compile_cache": "hit", "cache_key": key, "export_seconds": 0.0,
                             "seconds": time.perf_counter() - t0}
    captured = _captured(request, loaded, device, cache_dir if enabled else None)
    gm, ctx = optimise(captured, request.options, instruments, pass_services(device))
    info = {"compile_cache": "miss" if cache is not None else "off", "cache_key": key,
            "export_seconds": captured.export_seconds, "capture_cache": captured.info.get("capture_cache", "off")}
    if cache is not None:
        t1 = time.perf_counter()
        cache.store(key, gm, ctx, extra={"model_id": request.model_id})
        info["store_seconds"] = time.perf_counter() - t1
        from .pipeline_builder import release_free_memory, weight_bytes

        release_free_memory(weight_bytes(ctx.params))  # the serialised program's buffers
    info["seconds"] = time.perf_counter() - t0
    return gm, ctx, info


def _captured(request: ProgramRequest, loaded, device: torch.device, cache_dir):
    """The exported program: from the capture cache (:mod:`fxcompiler.capture_cache`) when ``cache_dir`` holds
    it, else by instantiating the model and exporting it (then stored there)."""
    from .capture import capture
    from .capture_cache import CaptureCache
    from .models.loader import instantiate_model

    key = request.capture_key(device) if cache_dir is not None else None
    cache = CaptureCache(cache_dir) if key is not None else None
    if cache is not None:
        hit = cache.load_captured(key)
        if hit is not None:
            return hit
    instantiate_model(loaded, use_random_weight=request.use_random_weight, dtype=request.dtype, seed=request.seed,
                      trust_remote_code=request.trust_remote_code)
    captured = capture(loaded.model.to(device), block_size=request.block_size)
    loaded.model = None  # the captured program owns the weights now; passes free what they replace
    from .pipeline_builder import collect_cycles, weight_bytes

    collect_cycles(weight_bytes(captured.params))  # free the model (transformers' cycles) before the passes run
    if cache is not None:
        cache.store_captured(key, captured)
        captured.info["capture_cache"] = "miss"
    return captured


def build(program: tuple[torch.fx.GraphModule, CompileContext], model_name: str, buckets: list[Bucket], *,
          block_size: int, device: torch.device, kind: str, options: dict[str, Any], param_file_path=None,
          param_saved_format="safetensors", cache_dir=None, program_key: str | None = None,
          num_compile_workers: int = 1, num_pipeline_builder_workers: int = 1) -> BuildResult:
    """Build one pipeline per bucket from an optimised program (params optionally written to a file).

    ``num_pipeline_builder_workers``: bucket pipelines are built in that many forked processes
    when there are enough buckets to pay for them (see ``pipeline_builder.MIN_BUCKETS_PER_WORKER``).

    ``num_compile_workers``: edf packages not in the cache are compiled in that many worker
    processes at once; the fx and dfg kinds have nothing expensive to compile and ignore it.

    ``program_key``: the program's compile-cache key; with ``cache_dir`` the fx pipelines are
    looked up in (and stored to) the build cache (:mod:`fxcompiler.build_cache`)."""
    t0 = time.perf_counter()
    if kind not in ("fx", "dfg", "edf"):
        raise ValueError(f"comp_supertask_kind must be 'fx', 'dfg' or 'edf', got {kind!r}")
    result = _build_fx(program, model_name, buckets, block_size=block_size, device=device, options=options,
                       cache_dir=cache_dir, program_key=program_key, workers=num_pipeline_builder_workers)
    if kind != "fx":  # the conversions read the blobs' meta['val']
        for p in result.pipelines:
            for blob in p.blobs.values():
                ensure_meta(blob.graph)
    result.source_graphs = {}  # converted blob id -> the fx graph it came from (artifacts keep both)
    if kind == "dfg":  # the fx blobs as ONNX ModelProtos (one conversion per unique blob)
        from .dfg import to_dfg_pipelines

        result.pipelines = to_dfg_pipelines(result.pipelines)
    elif kind == "edf":  # one AOTInductor package per unique blob, cached in cache_dir/edf
        from .edf import to_edf_pipelines

        fx_pipelines = result.pipelines
        stats: dict = {}
        result.pipelines = to_edf_pipelines(fx_pipelines, cache_dir, stats=stats, num_workers=num_compile_workers)
        for fx_pipe, edf_pipe in zip(fx_pipelines, result.pipelines):
            for key, task in edf_pipe.supertasks.items():
                if task.data_blob is not None:
                    fx_blob = fx_pipe.blobs[fx_pipe.supertasks[key].data_blob]
                    result.source_graphs[task.data_blob] = fx_blob.graph
        log.info("edf: %s", stats)
    if param_file_path is not None:
        info = save_params(result.params, param_file_path, param_saved_format)
        for p in result.pipelines:
            p.param_files = {k: info for k in p.param_files}
    if result.build_cache != "hit":  # built (and stored): the transient graphs, records and buffers back to the OS
        from .pipeline_builder import release_free_memory, weight_bytes

        release_free_memory(weight_bytes(result.params))
    log.info("build: %.1fs", time.perf_counter() - t0)
    return result


def _build_fx(program: tuple[torch.fx.GraphModule, CompileContext], model_name: str, buckets: list[Bucket], *,
              block_size: int, device: torch.device, options: dict[str, Any], cache_dir, program_key: str | None,
              workers: int = 1) -> BuildResult:
    """The fx pipelines of every bucket: from the build cache, else built (and stored there)."""
    from . import graph_io
    from .build_cache import BuildCache, build_key

    gm, ctx = program
    cache = key = None
    if cache_dir is not None and program_key is not None:
        cache = BuildCache(cache_dir, program_key)
        key = build_key(program_key, model_name, buckets, block_size=block_size, device=str(device), options=options)
        t0 = time.perf_counter()
        pipelines = cache.load(key)
        if pipelines is not None:
            log.info("build cache hit %s (%.2fs)", key, time.perf_counter() - t0)
            return BuildResult(pipelines, gm, ctx, time.perf_counter() - t0, {}, None, build_cache="hit")
    gm = graph_io.materialize(gm)  # a compile-cache hit defers the program's graph until something builds from it
    ensure_meta(gm)
    result = build_pipelines(None, buckets, model_name, kind="fx", device=str(device), block_size=block_size,
                             options=options, optimised=(gm, ctx), workers=workers)
    result.build_cache = "off"
    if cache is not None:
        result.build_cache = "miss" if cache.store(key, result.pipelines) else "uncacheable"
    return result


def start_engine(geometry: ModelGeometry, result: BuildResult, *, prefill_buckets: list[Bucket],
                 decode_buckets: list[Bucket], scheduler_config: SchedulerConfig, kv: KvCachePlan,
                 device: torch.device, tokenizer, eos_token_ids: frozenset[int], max_context: int,
                 kv_scales=None, kv_dtype: torch.dtype | None = None):
    from backends import get_backend
    from runtime.block_manager import BlockManager, PagedKVCache
    from runtime.engine import Engine
    from runtime.model_runner import ModelRunner
    from runtime.scheduler import Scheduler

    if device.type == "cpu":
        from backends.cpu.huge_pages import place_in_huge_pages

        place_in_huge_pages(result.params)  # the weights every decode step streams: 2 MiB pages, fewer TLB misses
    by_bucket: dict[Bucket, Pipeline] = {p.bucket: p for p in result.pipelines}
    compiled: dict[str, Any] = {}
    executables = {}
    for bucket, pipe in by_bucket.items():
        kinds = {t.kind.value for _, t in pipe.compute_supertasks()}
        if len(kinds) != 1:
            raise NotImplementedError(f"pipeline {pipe.name} mixes supertask kinds {sorted(kinds)}")
        blob_ids = tuple(sorted(b.id for b in pipe.blobs.values()))
        key = ",".join(blob_ids)
        if key not in compiled:
            compiled[key] = get_backend(kinds.pop(), device.type)(pipe, result.params, device)
        executables[bucket] = compiled[key]
    g = geometry
    cache = PagedKVCache(g.num_layers, kv.num_blocks, kv.block_size, g.num_kv_heads, g.head_dim,
                         kv_dtype or (torch.int8 if kv_scales is not None else g.dtype), device, kv_scales=kv_scales)
    blocks = BlockManager(kv.num_blocks, kv.block_size, kv.max_seqs, kv.max_blocks_per_seq)
    scheduler = Scheduler(scheduler_config, blocks, prefill_buckets, decode_buckets)

    class _Executables(dict):
        """Falls back to the shared executable for buckets made up at run time (recompute)."""

        def __missing__(self, bucket):
            return next(iter(compiled.values()))

    runner = ModelRunner(_Executables(executables), cache, blocks, device)
    return Engine(runner, scheduler, tokenizer, eos_token_ids, max_context, vocab_size=g.vocab_size)
