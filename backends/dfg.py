"""``dfg`` backend: run a pipeline of ONNX (dfg) supertasks on cpu or cuda.

Each unique dfg blob (an ``onnx.ModelProto`` from :func:`fxcompiler.dfg.fx_to_onnx`) is
turned back into an fx GraphModule once (:func:`fxcompiler.dfg.onnx_to_fx`: every ONNX node
becomes the torch op it names), with its constants on the target device; the pipeline is
then run by the fx executor (:class:`backends.fx.FxExecutable`, through the fx factory of the
device kind), so a step costs the same as with fx supertasks (on CPU one native program for the
whole plan, :mod:`backends.graph_program`; elsewhere one Python call into the graph code per
supertask).
"""
from __future__ import annotations

import weakref

import torch

from fxcompiler.pipeline import DataBlob, Pipeline, SuperTaskKind, retarget_compute_supertasks

from . import register_backend

# (blob id, device) -> GraphModule, alive while some executable uses it; blob ids are content hashes.
_GRAPHS: weakref.WeakValueDictionary[tuple[str, str], torch.fx.GraphModule] = weakref.WeakValueDictionary()


def graph_module_for(blob: DataBlob, device: torch.device) -> torch.fx.GraphModule:
    """The fx GraphModule of a dfg blob with its constants on ``device`` (converted once per blob id)."""
    import onnx

    from fxcompiler.dfg import onnx_to_fx

    if blob.kind != "dfg" or not isinstance(blob.graph, onnx.ModelProto):
        raise ValueError(f"blob {blob.id} is a {blob.kind!r} blob holding {type(blob.graph).__name__}; "
                         "the dfg backend runs 'dfg' blobs holding an onnx.ModelProto")
    key = (blob.id, str(torch.device(device)))
    gm = _GRAPHS.get(key)
    if gm is None:
        gm = onnx_to_fx(blob.graph, device=device, class_name=f"Dfg_{blob.id}")
        _GRAPHS[key] = gm
    return gm


def as_fx_pipeline(pipeline: Pipeline, device: torch.device) -> Pipeline:
    """A copy of a dfg pipeline whose compute supertasks are fx supertasks over the converted
    GraphModules (same blob ids, tensors, params), for the fx executor."""
    comps = pipeline.compute_supertasks()
    if not comps or any(t.kind is not SuperTaskKind.DFG for _, t in comps):
        raise NotImplementedError("the dfg executor runs pipelines of dfg compute supertasks only")
    return retarget_compute_supertasks(pipeline, SuperTaskKind.DFG, SuperTaskKind.FX,
                                       lambda blob: DataBlob(blob.id, "fx", graph_module_for(blob, device)))


def _compile(fx_factory, pipeline: Pipeline, params: dict[str, torch.Tensor], device: torch.device):
    executable = fx_factory(as_fx_pipeline(pipeline, device), params, device)
    executable.supertask_kind = "dfg"
    executable.dfg_models = {task.data_blob: pipeline.blobs[task.data_blob].graph
                             for _, task in pipeline.compute_supertasks()}
    return executable


@register_backend("dfg", "cpu")
def compile_dfg_cpu(pipeline: Pipeline, params: dict[str, torch.Tensor], device: torch.device):
    from .fx import compile_fx_cpu

    return _compile(compile_fx_cpu, pipeline, params, device)


@register_backend("dfg", "cuda")
def compile_dfg_cuda(pipeline: Pipeline, params: dict[str, torch.Tensor], device: torch.device):
    from .fx import compile_fx_cuda

    return _compile(compile_fx_cuda, pipeline, params, device)
