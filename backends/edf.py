"""``edf`` backend: run a pipeline of AOTInductor-package (edf) supertasks on cpu or cuda.

Each unique edf blob (an :class:`fxcompiler.edf.EdfPackage`, from
:func:`fxcompiler.edf.to_edf_pipelines`) is loaded once per device with
``torch._inductor.aoti_load_package``; a thin :class:`EdfModule` exposes the loaded model as
``forward(*flat_tensors) -> list of outputs`` (straight into the loader's ``boxed_run``, without
the pytree round trip of ``AOTICompiledModel.__call__``). The pipeline is then run by the fx
executor (:class:`backends.fx.FxExecutable`) over those modules, like the dfg backend does:
weights are bound per supertask, so identical blocks share one loaded package. The packages
update the KV-cache inputs in place, as the fx graphs do.

Packages compiled for CPU call ``fxc::linear`` / ``fxc::linear_w8`` / ``fxc::linear_f8`` / ``fxc::paged_attention``
through AOTInductor's proxy executor (:data:`fxcompiler.edf.EXTERN_OPS`), which resolves them
in the c10 dispatcher when the package loads: the ``fxc`` schemas must be defined by then
(imported below) and the CPU backend installs the C++ kernels before loading, as the fx
backend does (``fxc::linear``'s kernel library loads on its first call).
"""
from __future__ import annotations

import weakref

import torch

from fxcompiler.ops import paged_attention  # noqa: F401  (defines every fxc op: packages that call them must find them)
from fxcompiler.pipeline import (
    DataBlob,
    Pipeline,
    SuperTaskKind,
    retarget_compute_supertasks,
)

from . import register_backend


class EdfModule:
    """A loaded edf package with the interface the fx executor calls: ``forward(*inputs)``
    returns the outputs as a list (the graph's flat output tuple)."""

    def __init__(self, package, device: torch.device):
        from torch._inductor import aoti_load_package

        self.package = package
        self.device = torch.device(device)
        index = self.device.index if self.device.type != "cpu" and self.device.index is not None else -1
        self.compiled = aoti_load_package(package.path, device_index=index)
        loader = self.compiled.loader
        in_spec, out_spec = (torch.utils._pytree.treespec_loads(s) for s in loader.get_call_spec())
        self.num_inputs = in_spec.num_leaves
        flat_out = out_spec.type in (tuple, list) and all(c.num_leaves == 1 and c.num_children == 0
                                                           for c in out_spec.children())
        if flat_out:
            boxed_run = loader.boxed_run
            self.forward = lambda *args: boxed_run(list(args))
        else:
            self.forward = self.compiled  # the loader's own (pytree) call

    def __call__(self, *args):
        return self.forward(*args)


# (blob id, device) -> loaded package, alive while some executable uses it; blob ids are content keys.
_MODULES: weakref.WeakValueDictionary[tuple[str, str], EdfModule] = weakref.WeakValueDictionary()


def module_for(blob: DataBlob, device: torch.device) -> EdfModule:
    """The loaded package of an edf blob on ``device`` (loaded once per blob id and device)."""
    from fxcompiler.edf import EdfPackage

    if blob.kind != "edf" or not isinstance(blob.graph, EdfPackage):
        raise ValueError(f"blob {blob.id} is a {blob.kind!r} blob holding {type(blob.graph).__name__}; "
                         "the edf backend runs 'edf' blobs holding an fxcompiler.edf.EdfPackage")
    device = torch.device(device)
    if blob.graph.device_type != device.type:
        raise ValueError(f"edf blob {blob.id} was compiled for {blob.graph.device_type}, not {device.type}")
    key = (blob.id, str(device))
    mod = _MODULES.get(key)
    if mod is None:
        mod = EdfModule(blob.graph, device)
        _MODULES[key] = mod
    return mod


def as_fx_pipeline(pipeline: Pipeline, device: torch.device) -> Pipeline:
    """A copy of an edf pipeline whose compute supertasks are fx supertasks over the loaded
    packages (same blob ids, tensors, params), for the fx executor."""
    comps = pipeline.compute_supertasks()
    if not comps or any(t.kind is not SuperTaskKind.EDF for _, t in comps):
        raise NotImplementedError("the edf executor runs pipelines of edf compute supertasks only")
    return retarget_compute_supertasks(pipeline, SuperTaskKind.EDF, SuperTaskKind.FX,
                                       lambda blob: DataBlob(blob.id, "fx", module_for(blob, device)))


def _compile(pipeline: Pipeline, params: dict[str, torch.Tensor], device: torch.device):
    from .fx import FxExecutable

    executable = FxExecutable(as_fx_pipeline(pipeline, device), params, device)
    executable.supertask_kind = "edf"
    executable.edf_packages = {task.data_blob: pipeline.blobs[task.data_blob].graph
                               for _, task in pipeline.compute_supertasks()}
    return executable


@register_backend("edf", "cpu")
def compile_edf_cpu(pipeline: Pipeline, params: dict[str, torch.Tensor], device: torch.device):
    from .cpu import attention

    attention.install()  # the packages' fxc::paged_attention calls reach the C++ decode kernel (ATen otherwise)
    return _compile(pipeline, params, device)


@register_backend("edf", "cuda")
def compile_edf_cuda(pipeline: Pipeline, params: dict[str, torch.Tensor], device: torch.device):
    return _compile(pipeline, params, device)
