"""``fx`` backend: run an ATen GraphModule supertask eagerly on cpu or cuda.

The executable binds the pipeline's parameter tensors once (moved to the device),
so a step costs one Python call into the generated graph code plus the ATen ops.
"""
from __future__ import annotations

import torch

from fxcompiler.ops import paged_attention  # noqa: F401  (the graph calls fxc::paged_attention)
from fxcompiler.pipeline import ParamInfo, Pipeline, SuperTaskKind

from . import register_backend


class FxExecutable:
    """Callable ``(*user_inputs) -> logits`` for a pipeline made of one fx compute supertask."""

    def __init__(self, pipeline: Pipeline, params: dict[str, torch.Tensor], device: torch.device):
        comps = pipeline.compute_supertasks()
        if len(comps) != 1 or comps[0][1].kind is not SuperTaskKind.FX:
            raise NotImplementedError("the fx executor runs pipelines of exactly one fx supertask so far")
        task = comps[0][1]
        self.graph_module = pipeline.blobs[task.data_blob].graph
        self.device = device
        bound, self.user_inputs = [], []
        for name in task.inputs:
            info = pipeline.tensors[name]
            if isinstance(info, ParamInfo):
                if self.user_inputs:
                    raise ValueError("parameter inputs must precede user inputs")
                bound.append(params[info.value.name].to(device))
            else:
                self.user_inputs.append(name)
        self._bound = tuple(bound)
        self._forward = self.graph_module.forward

    def __call__(self, *user_inputs: torch.Tensor) -> torch.Tensor:
        out = self._forward(*self._bound, *user_inputs)
        return out[0] if isinstance(out, (tuple, list)) else out


@register_backend("fx", "cpu")
def compile_fx_cpu(pipeline: Pipeline, params: dict[str, torch.Tensor], device: torch.device) -> FxExecutable:
    from .cpu import attention

    attention.install()  # C++ decode kernel for fxc::paged_attention (falls back to ATen with a warning)
    return FxExecutable(pipeline, params, device)


@register_backend("fx", "cuda")
def compile_fx_cuda(pipeline: Pipeline, params: dict[str, torch.Tensor], device: torch.device) -> FxExecutable:
    return FxExecutable(pipeline, params, device)
