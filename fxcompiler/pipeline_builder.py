"""Turn a captured program into per-bucket :class:`Pipeline` s: passes, then supertasks.

The captured graph is shape-dynamic, so every bucket's pipeline references the same
graph blobs and parameters; the bucket fixes the shapes recorded in the pipeline and the
padding the runtime applies.

Options (``options``, i.e. ``compiler_config_overrides`` plus what the façade adds):

* ``use_blockwise_compile`` (default ``True``): the optimised graph is cut by
  :func:`passes.blockwise.partition_blockwise` into ``input → embed → block supertasks →
  head → output``, with named intermediate tensors (``embed_out<i>``, ``block<g>_out<i>``,
  ``logits``); structurally identical blocks reference one blob (content hash) and differ
  only in their parameter bindings and KV-cache inputs. ``False`` (or a graph without a
  layer structure): one ``fx`` supertask holding the whole graph.
* ``num_blocks_per_supertask`` (default 1): consecutive blocks per block supertask (the
  last one may be shorter and then has its own blob).
* ``num_blocks_per_pp_stage``: recorded in ``Pipeline.metadata`` for pipeline parallelism.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .capture import CapturedProgram
from .param_memory import trim_heap
from .pass_manager import CompileContext, PassInstrument, PassManager, build_pass_list
from .pipeline import (
    Bucket,
    DataBlob,
    ParamFileInfo,
    ParamInfo,
    ParamValue,
    Pipeline,
    SuperTask,
    SuperTaskKind,
    TensorInfo,
    dtype_name,
    pipeline_name,
)

log = logging.getLogger("fxcompiler.build")

MEMORY_PARAM_FILE = "0"


@dataclass
class BuildResult:
    pipelines: list[Pipeline]
    graph_module: torch.fx.GraphModule
    context: CompileContext
    seconds: float = 0.0
    pass_seconds: dict[str, float] = field(default_factory=dict)
    partition: Any = None  # passes.blockwise.BlockwisePartition when built blockwise
    build_cache: str = "off"  # hit / miss / uncacheable / off (fxcompiler.build_cache)

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return self.context.params


def optimise(captured: CapturedProgram, options: dict[str, Any] | None = None,
             instruments=None, services: dict[str, Any] | None = None) -> tuple[torch.fx.GraphModule, CompileContext]:
    """Run the configured pass list over the captured graph (the context takes over its parameters).

    ``services``: objects the passes may use but cannot import (layering), e.g. the CPU backend's
    ``kernel_tuner`` for ``lower_cpu_kernels``; they join ``ctx.options`` (not user overrides)."""
    ctx = CompileContext(list(captured.input_specs), captured.params, captured.geometry,
                         {**(options or {}), **(services or {})})
    captured.params = {}
    loaded = {t.untyped_storage().data_ptr() for t in ctx.params.values()}
    if instruments is None:
        from .instruments import instruments_from_options

        instruments = instruments_from_options(options or {})
    manager = PassManager(build_pass_list(options), instruments=[*instruments, _TrimHeapAfterPass()])
    gm = manager(captured.graph_module, ctx)
    compact_params(ctx.params, loaded)
    release_free_memory(weight_bytes(ctx.params))
    return gm, ctx


class _TrimHeapAfterPass(PassInstrument):
    """Hands the heap pages a pass freed back to the OS before the next pass allocates. glibc keeps freed
    chunks below its (adaptive) mmap threshold mapped, so the weights a pass replaced (transposed, fused,
    quantized) stayed resident beside their replacements and the build's high-water mark grew pass by pass
    (SmolLM2 native Q4_1: +130 MiB over the live data at fuse_projections). A trim walks the free lists: a
    few ms a pass."""

    def run_after_pass(self, p, result, ctx, seconds) -> None:
        if result.modified:
            trim_heap()


# Below this many bytes of weights a build does not run a full garbage collection: it costs 0.3-0.5 s in a process
# with torch and transformers loaded (3 a build), and what it would free early (the model's modules, graphs) is of
# the order of the weights; the interpreter's own collections free it later.
GC_MIN_WEIGHT_BYTES = 32 << 20


def weight_bytes(params: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct storages ``params`` hold (views of one storage counted once)."""
    seen: dict[int, int] = {}
    for t in params.values():
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def collect_cycles(nbytes: int | None = None) -> None:
    """A full garbage collection (transformers modules and fx graphs hold reference cycles) when the build's weights
    (``nbytes``; None: unknown) are at least :data:`GC_MIN_WEIGHT_BYTES`."""
    import gc

    if nbytes is None or nbytes >= GC_MIN_WEIGHT_BYTES:
        gc.collect()


def release_free_memory(nbytes: int | None = None) -> None:
    """Hand freed heap pages back to the OS (glibc keeps them after the passes' churn), after
    :func:`collect_cycles`."""
    collect_cycles(nbytes)
    trim_heap()


def compact_params(params: dict[str, torch.Tensor], loaded: set[int]) -> int:
    """Copy the parameters no pass replaced into memory of their own.

    Checkpoint tensors are views into the mmap of the whole weights file; while one of
    them lives (the embedding, the norms) the whole mapping and every page the passes
    read stay resident. Copying the survivors releases it. Returns the bytes copied."""
    copied, done = 0, {}
    for name, t in params.items():
        ptr = t.untyped_storage().data_ptr()
        if ptr in loaded:
            key = (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if key not in done:
                done[key] = t.clone(memory_format=torch.contiguous_format)
                copied += t.numel() * t.element_size()
            params[name] = done[key]
    return copied


def _user_tensor_infos(ctx: CompileContext, bucket: Bucket, block_size: int) -> dict[str, TensorInfo]:
    g = ctx.geometry
    b, t = bucket.batch_size, bucket.input_ids_size
    mb = -(-bucket.attention_size // block_size)
    shapes: dict[str, tuple[list, str]] = {
        "input_ids": ([b, t], "i64"), "position_ids": ([b, t], "i64"),
        "block_table": ([b, mb], "i64"), "slot_mapping": ([b, t], "i64"), "seq_lens": ([b], "i64"),
        "logits_indices": ([b], "i64"),
    }
    for i in range(g.num_layers):
        for kv in ("k", "v"):
            shapes[f"{kv}_cache_{i}"] = (["num_blocks", block_size, g.num_kv_heads, g.head_dim], dtype_name(g.dtype))
    return {k: TensorInfo(*v) for k, v in shapes.items()}


def _constants_digest(gm: torch.fx.GraphModule) -> str:
    """Hash of the weights a graph carries as constants (``embed_all_constants_into_graph``):
    two graphs with the same code but different embedded weights are different blobs."""
    names = sorted(gm.meta.get("fxc_constants", {}))
    if not names:
        return ""
    h = hashlib.sha256()
    for name in names:
        t = getattr(gm, name).detach().contiguous()
        h.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "\n# constants " + h.hexdigest()


def build_pipelines(captured: CapturedProgram, buckets: list[Bucket], model_name: str, *, kind: str = "fx",
                    device: str = "cpu", block_size: int = 16, options: dict[str, Any] | None = None,
                    instruments=None, param_file: ParamFileInfo | None = None,
                    services: dict[str, Any] | None = None,
                    optimised: tuple[torch.fx.GraphModule, CompileContext] | None = None,
                    workers: int = 1) -> BuildResult:
    """One pipeline per bucket. ``optimised``: an already optimised ``(graph, context)`` (e.g. from a
    compile cache); when given, :func:`optimise` is not called and ``captured`` only names the model.
    ``workers``: ``num_pipeline_builder_workers`` (see :func:`_build_bucket_pipelines`)."""
    if kind != "fx":
        raise ValueError(f"build_pipelines builds 'fx' supertasks, got kind={kind!r}: 'dfg' and 'edf' pipelines "
                         "are converted from them (fxcompiler/build.py, with fxcompiler/dfg.py and edf.py)")
    t0 = time.perf_counter()
    gm, ctx = optimised if optimised is not None else optimise(captured, options, instruments, services)
    options = options or {}
    param_file = param_file or ParamFileInfo("", "memory")
    user_names = [s.name for s in ctx.input_specs if s.kind == "user"]
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    out_val = getattr(out[0] if isinstance(out, (tuple, list)) else out, "meta", {}).get("val")
    logits_dtype = out_val.dtype if isinstance(out_val, torch.Tensor) else ctx.geometry.dtype  # bf16 graphs: fp32
    partition = _blockwise_partition(gm, ctx, options)
    if partition is None:
        blob = DataBlob(DataBlob.content_id("fx", gm.code + _constants_digest(gm)), "fx", gm)
        blobs = {blob.id: blob}
        params = {
            s.name: ParamInfo(list(ctx.params[s.target].shape), dtype_name(ctx.params[s.target].dtype),
                              ParamValue(MEMORY_PARAM_FILE, s.target, s.name))
            for s in ctx.input_specs if s.kind == "param"
        }
        compute = [SuperTask(SuperTaskKind.FX, [s.name for s in ctx.input_specs], ["logits"], device="0",
                             data_blob=blob.id)]
        extra_meta: dict[str, Any] = {}
    else:
        blobs = {bid: DataBlob(bid, "fx", g) for bid, g in partition.blobs.items()}
        params, compute = _blockwise_supertasks(partition, ctx)
        extra_meta = {"blockwise": {
            "layer_prefix": partition.layer_prefix, "num_blocks": len(partition.layers),
            "num_blocks_per_supertask": partition.num_blocks_per_supertask,
            "supertasks": {str(i + 1): {"part": p.role, "layers": list(p.layers)}
                           for i, p in enumerate(partition.parts)},
            "unique_block_blobs": len(partition.block_blobs)}}
    if options.get("num_blocks_per_pp_stage") is not None:
        extra_meta["num_blocks_per_pp_stage"] = [int(x) for x in options["num_blocks_per_pp_stage"]]
    _dump_supertask_graphs(options, blobs, compute)
    dims = _dim_symbols(gm, ctx) if partition is not None else {}
    job = _BucketJob(model_name, device, block_size, params, compute, blobs, param_file, extra_meta, user_names,
                     logits_dtype, dims, ctx, partition)
    pipelines = _build_bucket_pipelines(job, buckets, workers)
    seconds = time.perf_counter() - t0
    pass_seconds = {}
    for h in ctx.history:
        pass_seconds[h["pass"]] = pass_seconds.get(h["pass"], 0.0) + h["seconds"]
    log.info("built %d pipelines (%d compute supertasks, %d blobs, %d nodes) in %.2fs", len(pipelines),
             len(compute), len(blobs), len(gm.graph.nodes), seconds)
    return BuildResult(pipelines, gm, ctx, seconds, pass_seconds, partition)


# Buckets per worker below which workers are not started. A bucket's pipeline takes ~1.3 ms
# in-process (one shape-dynamic graph serves every bucket); forking and pickling the pipelines
# back cost about as much: SmolLM2's 277 default buckets took 0.61 s in-process, 0.67 s with 2
# workers and 1.96 s with 4 on this 2-core machine.
MIN_BUCKETS_PER_WORKER = 256


@dataclass
class _BucketJob:
    """Everything one bucket's pipeline is made from (shared by every bucket of a build)."""

    model_name: str
    device: str
    block_size: int
    params: dict[str, ParamInfo]
    compute: list[SuperTask]
    blobs: dict[str, DataBlob]
    param_file: ParamFileInfo
    extra_meta: dict[str, Any]
    user_names: list[str]
    logits_dtype: torch.dtype
    dims: dict
    ctx: CompileContext
    partition: Any


_FORKED_JOB: _BucketJob | None = None  # the job a forked builder worker inherits


def _build_bucket_pipelines(job: _BucketJob, buckets: list[Bucket], workers: int) -> list[Pipeline]:
    """One pipeline per bucket, in order. ``workers > 1``: buckets are split over that many
    forked processes (each inherits the job; pipelines come back without their graphs, which
    are re-attached here) when there are at least :data:`MIN_BUCKETS_PER_WORKER` per worker
    and the platform can fork; otherwise they are built in this process."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"num_pipeline_builder_workers must be a positive int, got {workers!r}")
    workers = min(workers, len(buckets) // MIN_BUCKETS_PER_WORKER)
    if workers > 1:
        import multiprocessing as mp

        if "fork" in mp.get_all_start_methods():
            global _FORKED_JOB
            chunks = [buckets[i::workers] for i in range(workers)]
            _FORKED_JOB = job
            try:
                with mp.get_context("fork").Pool(workers) as pool:
                    parts = pool.map(_forked_bucket_pipelines, chunks)
            finally:
                _FORKED_JOB = None
            built = {}
            for chunk, part in zip(chunks, parts):
                for bucket, pipe in zip(chunk, part):
                    pipe.blobs = {k: job.blobs[b.id] for k, b in pipe.blobs.items()}
                    built[bucket] = pipe
            log.info("built %d pipelines in %d worker processes", len(built), workers)
            return [built[b] for b in buckets]
        log.info("num_pipeline_builder_workers=%d: this platform cannot fork; building in-process", workers)
    memo: dict = {}
    return [_bucket_pipeline(job, bucket, memo) for bucket in buckets]


def _forked_bucket_pipelines(buckets: list[Bucket]) -> list[Pipeline]:
    job = _FORKED_JOB
    bare = dataclasses.replace(job, blobs={k: DataBlob(b.id, b.kind) for k, b in job.blobs.items()})
    memo: dict = {}
    return [_bucket_pipeline(bare, bucket, memo) for bucket in buckets]


def _bucket_pipeline(job: _BucketJob, bucket: Bucket, memo: dict) -> Pipeline:
    ctx, partition, compute = job.ctx, job.partition, job.compute
    model_name, device, block_size, blobs = job.model_name, job.device, job.block_size, job.blobs
    param_file, extra_meta, user_names, logits_dtype, dims = (job.param_file, job.extra_meta, job.user_names,
                                                              job.logits_dtype, job.dims)
    tensors: dict[str, TensorInfo | ParamInfo] = dict(job.params)
    infos = _user_tensor_infos(ctx, bucket, block_size)
    for spec in ctx.input_specs:
        if spec.kind == "user":
            tensors[spec.name] = _shared(memo, infos[spec.target])
    if partition is not None:
        for name, val in partition.intermediates.items():
            tensors[name] = _shared(memo, _intermediate_info(val, dims, bucket, memo))
    tensors["logits"] = _shared(memo, TensorInfo([bucket.batch_size, ctx.geometry.vocab_size], dtype_name(logits_dtype)))
    if "supertasks" not in memo:  # the same for every bucket: one set of objects, as the build cache decodes them
        shared = {"0": SuperTask(SuperTaskKind.INPUT, [], user_names)}
        for i, task in enumerate(compute):
            shared[str(i + 1)] = SuperTask(task.kind, list(task.inputs), list(task.outputs), task.device,
                                           task.data_blob, dict(task.metadata))
        shared[str(len(compute) + 1)] = SuperTask(SuperTaskKind.OUTPUT, ["logits"], [])
        memo["supertasks"] = shared
    supertasks = dict(memo["supertasks"])
    return Pipeline(
        name=pipeline_name(model_name, bucket), bucket=bucket, devices={"0": device}, tensors=tensors,
        supertasks=supertasks, blobs=dict(blobs), param_files={MEMORY_PARAM_FILE: param_file},
        metadata={"output_logits_size": 1, "block_size": block_size,
                  "inputs": {s.name: s.target for s in ctx.input_specs if s.kind == "user"},
                  "dynamic_dims": ["num_blocks", "block_table[1] <= bucket attention blocks"], **extra_meta},
    )


def _dump_supertask_graphs(options: dict[str, Any], blobs: dict[str, DataBlob], compute: list[SuperTask]) -> None:
    """With a dump dir (``dump_dir`` / ``FXCOMPILER_DUMP_DIR``): ``supertasks/NN-<part>.py``, the graph of
    each compute supertask as partitioned (blocks sharing a blob are written once, named by the first)."""
    import os
    from pathlib import Path

    root = options.get("dump_dir") or os.environ.get("FXCOMPILER_DUMP_DIR")
    if not root:
        return
    out = Path(root) / "supertasks"
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, str] = {}
    index = []
    for i, task in enumerate(compute, 1):
        label = (task.metadata or {}).get("label") or (task.metadata or {}).get("part") or "graph"
        name = f"{i:02d}-{''.join(c if c.isalnum() or c in '-_' else '_' for c in str(label))}.py"
        if task.data_blob not in written:
            graph = blobs[task.data_blob].graph
            (out / name).write_text(graph.code if hasattr(graph, "code") else str(graph))
            written[task.data_blob] = name
        index.append(f"{i:02d} {label}: inputs {task.inputs} -> outputs {task.outputs}; graph {written[task.data_blob]}")
    (out / "index.txt").write_text("\n".join(index) + "\n")


def _blockwise_partition(gm: torch.fx.GraphModule, ctx: CompileContext, options: dict[str, Any]):
    """The blockwise partition the options ask for (``use_blockwise_compile``, default on;
    ``num_blocks_per_supertask``, default 1), or None for one supertask. A graph without a
    layer structure falls back to one supertask with a warning."""
    if not options.get("use_blockwise_compile", True):
        return None
    from passes.blockwise import BlockwiseError, partition_blockwise

    k = options.get("num_blocks_per_supertask", 1)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_blocks_per_supertask must be a positive int, got {k!r}")
    try:
        return partition_blockwise(gm, ctx, num_blocks_per_supertask=k)
    except BlockwiseError as exc:
        log.warning("blockwise compilation: %s; building one supertask per pipeline", exc)
        return None


def _blockwise_supertasks(partition, ctx: CompileContext) -> tuple[dict[str, ParamInfo], list[SuperTask]]:
    """ParamInfos (keyed by the parameter's placeholder name in the optimised graph, bound to
    the placeholder of the part that reads it) and one fx supertask per part."""
    by_target = {s.target: s.name for s in ctx.input_specs if s.kind == "param"}
    params: dict[str, ParamInfo] = {}
    compute = []
    for part in partition.parts:
        names = []
        for ph, target in part.params:
            name = by_target[target]
            value = ctx.params[target]
            params.setdefault(name, ParamInfo(list(value.shape), dtype_name(value.dtype),
                                              ParamValue(MEMORY_PARAM_FILE, target, ph)))
            names.append(name)
        meta = {"part": part.role, "label": part.label}
        if part.layers:
            meta["layers"] = list(part.layers)
        compute.append(SuperTask(SuperTaskKind.FX, names + list(part.inputs), list(part.outputs), device="0",
                                 data_blob=part.blob_id, metadata=meta))
    return params, compute


def _dim_symbols(gm: torch.fx.GraphModule, ctx: CompileContext) -> dict:
    """sympy symbol of each dynamic user-input dim -> its name (batch, tokens, ...)."""
    where = {"input_ids": ("batch", "tokens"), "block_table": (None, "table_blocks"),
             "logits_indices": ("logit_rows",), "k_cache_0": ("num_blocks",)}
    targets = {s.name: s.target for s in ctx.input_specs if s.kind == "user"}
    dims = {}
    for n in gm.graph.nodes:
        if n.op != "placeholder" or targets.get(n.name) not in where:
            continue
        val = n.meta.get("val")
        for size, name in zip(getattr(val, "shape", ()), where[targets[n.name]]):
            if name is not None and isinstance(size, torch.SymInt):
                expr = size.node.expr
                if getattr(expr, "is_Symbol", False):
                    dims.setdefault(expr, name)
    return dims


def _shared(memo: dict, info: TensorInfo) -> TensorInfo:
    """One object per distinct (shape, dtype) over a build: pipelines share their records, as
    :func:`~fxcompiler.pipeline.pipelines_from_compact` decodes them (nothing mutates them after a build;
    SmolLM2's default buckets held ~10^5 TensorInfo copies)."""
    return memo.setdefault(("info", tuple(info.shape), info.dtype), info)


def _intermediate_info(val, dims: dict, bucket: Bucket, memo: dict | None = None) -> TensorInfo:
    """TensorInfo of a value crossing supertasks: batch/tokens dims take the bucket's sizes,
    other dynamic dims stay symbolic strings (``num_blocks``, ``logit_rows``...).
    ``memo``: (expr, batch, tokens) -> dim, shared over a build (the block boundaries of a
    model repeat a handful of expressions; sympy substitution dominated building)."""
    if not isinstance(val, torch.Tensor):
        return TensorInfo([], type(val).__name__.lower())
    memo = {} if memo is None else memo
    concrete = {"batch": bucket.batch_size, "tokens": bucket.input_ids_size}
    shape: list[int | str] = []
    for size in val.shape:
        if not isinstance(size, torch.SymInt):
            shape.append(int(size))
            continue
        expr = size.node.expr
        key = (expr, concrete["batch"], concrete["tokens"])
        dim = memo.get(key)
        if dim is None:
            import sympy

            subs = {sym: sympy.Integer(concrete[name]) if name in concrete else sympy.Symbol(name)
                    for sym, name in dims.items() if sym in expr.free_symbols}
            done = expr.xreplace(subs)
            dim = memo[key] = int(done) if done.is_Integer else str(done)
        shape.append(dim)
    return TensorInfo(shape, dtype_name(val.dtype))
