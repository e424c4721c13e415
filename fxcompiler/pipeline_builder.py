"""Turn a captured program into per-bucket :class:`Pipeline` s: passes, then supertasks.

The captured graph is shape-dynamic, so every bucket's pipeline references the same
optimised graph blob (one content hash) and the same parameters; the bucket fixes the
shapes recorded in the pipeline and the padding the runtime applies.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .capture import CapturedProgram
from .pass_manager import CompileContext, PassManager, build_pass_list
from .pipeline import (Bucket, DataBlob, ParamFileInfo, ParamInfo, ParamValue, Pipeline, SuperTask,
                       SuperTaskKind, TensorInfo, dtype_name, pipeline_name)

log = logging.getLogger("fxcompiler.build")

MEMORY_PARAM_FILE = "0"


@dataclass
class BuildResult:
    pipelines: list[Pipeline]
    graph_module: torch.fx.GraphModule
    context: CompileContext
    seconds: float = 0.0
    pass_seconds: dict[str, float] = field(default_factory=dict)

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
    manager = PassManager(build_pass_list(options), instruments=instruments)
    gm = manager(captured.graph_module, ctx)
    compact_params(ctx.params, loaded)
    release_free_memory()
    return gm, ctx


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them after the passes' churn)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


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
                    optimised: tuple[torch.fx.GraphModule, CompileContext] | None = None) -> BuildResult:
    """One pipeline per bucket. ``optimised``: an already optimised ``(graph, context)`` (e.g. from a
    compile cache); when given, :func:`optimise` is not called and ``captured`` only names the model."""
    if kind != "fx":
        raise NotImplementedError(f"comp_supertask_kind={kind!r}: only 'fx' supertasks are built so far "
                                  "('dfg' and 'edf' belong to the blockwise-compilation work)")
    t0 = time.perf_counter()
    gm, ctx = optimised if optimised is not None else optimise(captured, options, instruments, services)
    blob = DataBlob(DataBlob.content_id("fx", gm.code + _constants_digest(gm)), "fx", gm)
    param_file = param_file or ParamFileInfo("", "memory")
    params = {
        s.name: ParamInfo(list(ctx.params[s.target].shape), dtype_name(ctx.params[s.target].dtype),
                          ParamValue(MEMORY_PARAM_FILE, s.target, s.name))
        for s in ctx.input_specs if s.kind == "param"
    }
    user_names = [s.name for s in ctx.input_specs if s.kind == "user"]
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    out_val = getattr(out[0] if isinstance(out, (tuple, list)) else out, "meta", {}).get("val")
    logits_dtype = out_val.dtype if isinstance(out_val, torch.Tensor) else ctx.geometry.dtype  # bf16 graphs: fp32
    pipelines = []
    for bucket in buckets:
        tensors: dict[str, TensorInfo | ParamInfo] = dict(params)
        infos = _user_tensor_infos(ctx, bucket, block_size)
        for spec in ctx.input_specs:
            if spec.kind == "user":
                tensors[spec.name] = infos[spec.target]
        tensors["logits"] = TensorInfo([bucket.batch_size, ctx.geometry.vocab_size], dtype_name(logits_dtype))
        supertasks = {
            "0": SuperTask(SuperTaskKind.INPUT, [], user_names),
            "1": SuperTask(SuperTaskKind.FX, [s.name for s in ctx.input_specs], ["logits"], device="0",
                           data_blob=blob.id),
            "2": SuperTask(SuperTaskKind.OUTPUT, ["logits"], []),
        }
        pipelines.append(Pipeline(
            name=pipeline_name(model_name, bucket), bucket=bucket, devices={"0": device}, tensors=tensors,
            supertasks=supertasks, blobs={blob.id: blob}, param_files={MEMORY_PARAM_FILE: param_file},
            metadata={"output_logits_size": 1, "block_size": block_size,
                      "inputs": {s.name: s.target for s in ctx.input_specs if s.kind == "user"},
                      "dynamic_dims": ["num_blocks", "block_table[1] <= bucket attention blocks"]},
        ))
    seconds = time.perf_counter() - t0
    pass_seconds = {}
    for h in ctx.history:
        pass_seconds[h["pass"]] = pass_seconds.get(h["pass"], 0.0) + h["seconds"]
    log.info("built %d pipelines (1 blob, %d nodes) in %.2fs", len(pipelines), len(gm.graph.nodes), seconds)
    return BuildResult(pipelines, gm, ctx, seconds, pass_seconds)
