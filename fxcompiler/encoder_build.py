"""Build an encoder task: load the transformers model for the task, capture it
(:mod:`fxcompiler.encoder_capture`), run the pass manager, cut the graph into blockwise fx supertasks
and make one :class:`~fxcompiler.pipeline.Pipeline` per bucket (no KV cache, no decode buckets).

Buckets are prefill-shaped ``(batch, attention)``: requests are padded to the smallest bucket that holds
their batch and their longest row; the graph is shape-dynamic, so every bucket's pipeline references the
same blobs and one executable serves them all.
"""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from .encoder_capture import EncoderGeometry, capture_encoder, is_encoder_family
from .encoder_tasks import EMBED, QA, SCORE
from .pass_manager import CompileContext
from .pipeline import (Bucket, DataBlob, ParamFileInfo, ParamInfo, ParamValue, Pipeline, SuperTask, SuperTaskKind,
                       TensorInfo, dtype_name, pipeline_name)

log = logging.getLogger("fxcompiler.build")

_AUTO_CLASSES = {QA: "AutoModelForQuestionAnswering", SCORE: "AutoModelForSequenceClassification", EMBED: "AutoModel"}


@dataclass
class EncoderBuild:
    pipelines: list[Pipeline]
    context: CompileContext
    graph_module: torch.fx.GraphModule
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def geometry(self) -> EncoderGeometry:
        return self.context.geometry

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return self.context.params


def check_task_model(config, task: str) -> None:
    """``NotImplementedError`` naming the architecture when ``task`` is not built for it."""
    from .models.support_check import UnsupportedModelError

    archs = list(getattr(config, "architectures", None) or []) or [type(config).__name__]
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{archs[0]}: encoder-decoder models are not supported for task {task!r}")
    if is_encoder_family(config):
        return
    from .capture import SUPPORTED_ARCHITECTURES

    if task != EMBED or not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise UnsupportedModelError(
            f"{archs[0]} (model_type {getattr(config, 'model_type', None)!r}) with task {task!r}: encoder tasks are "
            "built for BERT, RoBERTa and XLM-RoBERTa checkpoints (question answering, scoring, embedding) and for "
            "the tested decoder architectures as embedding models (task_type='embed', last-token pooling)")


def load_task_model(model_dir, config, task: str, *, dtype: torch.dtype | None, use_random_weight: bool,
                    seed: int | None, trust_remote_code: bool) -> torch.nn.Module:
    """The transformers model of ``task``: the task head's class for QA / scoring, the base model for embeddings
    (a causal LM's checkpoint loads into its base model, ``lm_head`` dropped)."""
    import transformers

    from .models.loader import target_dtype

    auto = getattr(transformers, _AUTO_CLASSES[task])
    dtype = target_dtype(config, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if use_random_weight:
            with torch.random.fork_rng():
                torch.manual_seed(0 if seed is None else seed)
                model = auto.from_config(config, trust_remote_code=trust_remote_code, dtype=dtype)
        else:
            model = auto.from_pretrained(str(model_dir), config=config, dtype=dtype, local_files_only=True,
                                         trust_remote_code=trust_remote_code)
    model = model.to(dtype).eval()
    model.requires_grad_(False)
    return model


def _instruments(options: dict):
    """The build's instruments, less the decoders' finite-logits check (it feeds decoder inputs); the encoder
    runner checks its outputs on a warm-up run instead (``EncoderRunner.warm_up``)."""
    from .instruments import FiniteCheckInstrument, instruments_from_options

    return [i for i in instruments_from_options(options) if not isinstance(i, FiniteCheckInstrument)]


def build_encoder(model: torch.nn.Module, task: str, model_name: str, buckets: list[Bucket], *, device: torch.device,
                  options: dict[str, Any]) -> EncoderBuild:
    """Capture → passes → pipelines of ``model`` for ``task`` (``options``: the compiler overrides and
    ``use_blockwise_compile`` / ``num_blocks_per_supertask``)."""
    from .build import pass_services
    from .pipeline_builder import optimise

    t0 = time.perf_counter()
    captured = capture_encoder(model.to(device), task)
    pass_options = {k: v for k, v in options.items() if k not in ("use_blockwise_compile", "num_blocks_per_supertask")}
    gm, ctx = optimise(captured, pass_options, _instruments(pass_options), pass_services(device))
    pipelines = encoder_pipelines(gm, ctx, buckets, model_name, device=str(device), options=options)
    info = {"export_seconds": captured.export_seconds, "seconds": time.perf_counter() - t0,
            "compile_cache": "off", "task": task}
    return EncoderBuild(pipelines, ctx, gm, info)


def _user_infos(g: EncoderGeometry, bucket: Bucket) -> dict[str, TensorInfo]:
    b, t = bucket.batch_size, bucket.attention_size
    infos = {"input_ids": TensorInfo([b, t], "i64"), "token_type_ids": TensorInfo([b, t], "i64"),
             "seq_lens": TensorInfo([b], "i64"), "pooling_weights": TensorInfo([b, t], dtype_name(g.dtype))}
    return {name: infos[name] for name in g.inputs}


def _output_info(g: EncoderGeometry, bucket: Bucket, dtype) -> TensorInfo:
    b, t = bucket.batch_size, bucket.attention_size
    shape = {QA: [b, t, 2], SCORE: [b, g.num_labels], EMBED: [b, g.hidden_size]}[g.task]
    return TensorInfo(shape, dtype_name(dtype))


def encoder_pipelines(gm: torch.fx.GraphModule, ctx: CompileContext, buckets: list[Bucket], model_name: str, *,
                      device: str = "cpu", options: dict[str, Any] | None = None) -> list[Pipeline]:
    """One pipeline per bucket over the optimised graph (blockwise: embedding → blocks → head, as the
    decoders; or one supertask)."""
    from .pipeline_builder import (MEMORY_PARAM_FILE, _blockwise_partition, _blockwise_supertasks, _constants_digest,
                                   _dim_symbols, _intermediate_info)

    options = options or {}
    g: EncoderGeometry = ctx.geometry
    user = [s for s in ctx.input_specs if s.kind == "user"]
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    out_val = getattr(out[0] if isinstance(out, (tuple, list)) else out, "meta", {}).get("val")
    out_dtype = out_val.dtype if isinstance(out_val, torch.Tensor) else g.dtype
    partition = _blockwise_partition(gm, ctx, options)
    if partition is None:
        blob = DataBlob(DataBlob.content_id("fx", gm.code + _constants_digest(gm)), "fx", gm)
        blobs = {blob.id: blob}
        params = {s.name: ParamInfo(list(ctx.params[s.target].shape), dtype_name(ctx.params[s.target].dtype),
                                    ParamValue(MEMORY_PARAM_FILE, s.target, s.name))
                  for s in ctx.input_specs if s.kind == "param"}
        compute = [SuperTask(SuperTaskKind.FX, [s.name for s in ctx.input_specs], ["logits"], device="0",
                             data_blob=blob.id)]
        meta: dict[str, Any] = {}
        dims: dict = {}
    else:
        blobs = {bid: DataBlob(bid, "fx", graph) for bid, graph in partition.blobs.items()}
        params, compute = _blockwise_supertasks(partition, ctx)
        meta = {"blockwise": {"layer_prefix": partition.layer_prefix, "num_blocks": len(partition.layers),
                              "unique_block_blobs": len(partition.block_blobs)}}
        dims = _dim_symbols(gm, ctx)
    pipelines, memo = [], {}
    for bucket in buckets:
        tensors: dict[str, TensorInfo | ParamInfo] = dict(params)
        infos = _user_infos(g, bucket)
        for s in user:
            tensors[s.name] = infos[s.target]
        if partition is not None:
            for name, val in partition.intermediates.items():
                tensors[name] = _intermediate_info(val, dims, bucket, memo)
        tensors["logits"] = _output_info(g, bucket, out_dtype)
        supertasks = {"0": SuperTask(SuperTaskKind.INPUT, [], [s.name for s in user])}
        for i, task in enumerate(compute):
            supertasks[str(i + 1)] = SuperTask(task.kind, list(task.inputs), list(task.outputs), task.device,
                                               task.data_blob, dict(task.metadata))
        supertasks[str(len(compute) + 1)] = SuperTask(SuperTaskKind.OUTPUT, ["logits"], [])
        pipelines.append(Pipeline(
            name=pipeline_name(model_name, bucket), bucket=bucket, devices={"0": device}, tensors=tensors,
            supertasks=supertasks, blobs=dict(blobs), param_files={MEMORY_PARAM_FILE: ParamFileInfo("", "memory")},
            metadata={"task": g.task, "inputs": {s.name: s.target for s in user}, **meta}))
    return pipelines
