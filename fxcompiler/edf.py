"""``edf`` supertasks: a compute graph compiled into an AOTInductor package (DESIGN §5).

:func:`to_edf_pipelines` turns the fx compute supertasks of built pipelines into ``edf``
ones: each unique fx blob (identical transformer blocks share one) is

1. prepared for export: the ``fxc::*`` ops that have fast kernels on the target device
   (:func:`extern_ops`; on CPU the linears (``linear``, ``linear_w8``, ``linear_f8``, ``linear_f8f8`` ...)
   and ``paged_attention``, the C++ kernels of ``backends/cpu``) stay calls into the op; every other ``fxc`` node (on CPU the
   fused elementwise ``rms_norm``, ``silu_mul``, ``rope``, which Inductor fuses with their
   neighbours at least as well; on CUDA all of them) calls its ATen reference from
   ``fxcompiler/ops`` instead, so Inductor generates code for it;
2. exported with ``torch.export.export`` (non-strict), every placeholder a graph input —
   weights included, so one package serves every block that shares the blob — and every
   symbolic dim of the blob (batch, tokens, blocks...) a named ``Dim``, so one package
   serves every bucket;
3. compiled with ``torch._inductor.aoti_compile_and_package`` into
   ``<cache_dir>/edf/<key>.pt2``. The kept ``fxc`` calls become AOTInductor *fallback
   kernels*: the package's ``<model>.wrapper.json`` describes each call and the generated
   code runs it with ``aoti_torch_proxy_executor_call_function``, which the runtime's
   proxy executor turns into a boxed call of the op, looked up in the c10 dispatcher when
   the package is loaded (~1 us a call measured here). The op only has to be registered in
   the loading process (``import fxcompiler`` defines the ``fxc`` schemas; loading fails
   with "Could not find schema for fxc::..." without them) and its kernel is whatever the
   dispatcher holds at call time (the edf CPU backend installs the C++ kernels; without them
   the op's ATen reference runs: same results, slower). ``key`` (:func:`package_key`) hashes
   the graph code and placeholder shapes (symbolic dims by order of appearance, not name),
   the device kind, the kept ops, the Inductor options (:data:`INDUCTOR_OPTIONS`), the torch
   version and the sources this module rewrites with, so a second conversion finds the
   package and compiles nothing. ``to_edf_pipelines(num_workers=n)`` compiles the missing
   packages in ``n`` spawned worker processes (:func:`compile_packages_in_workers`).

The paged KV-cache write stays an input mutation: ``fxc::paged_attention`` writes the
``k_cache``/``v_cache`` inputs in place (an extern call on CPU; ``index_copy_`` into views
of them where the reference is compiled), so the package updates the caller's cache tensors
as the fx graph does.

An edf :class:`~fxcompiler.pipeline.DataBlob` holds an :class:`EdfPackage` (the ``.pt2``
path and its key; blob id = ``key[:20]``); ``backends/edf.py`` loads it with
``torch._inductor.aoti_load_package``. :func:`serialize` / :func:`deserialize` give the
package bytes for artifacts.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from .pipeline import DataBlob, Pipeline, SuperTaskKind, retarget_compute_supertasks

FORMAT = "fxcompiler-edf/1"
PACKAGE_SUFFIX = ".pt2"
_REF_MODULES = ("fxcompiler.ops.fused", "fxcompiler.ops.paged_attention", "fxcompiler.ops.linear",
                "fxcompiler.ops.quant_linear",
                "fxcompiler.ops.moe")


class EdfCompileError(RuntimeError):
    """An fx blob could not be compiled into an AOTInductor package (no C++ compiler, export or
    compile failure); the message names the blob."""


@dataclasses.dataclass(frozen=True)
class EdfPackage:
    """A compiled edf blob: the AOTInductor package file and the key it was compiled under."""

    path: str
    key: str
    device_type: str = "cpu"

    def read_bytes(self) -> bytes:
        return Path(self.path).read_bytes()


# --------------------------------------------------------------------------- fxc ops -> ATen

# fxc ops (by name) that stay calls into the op inside a package, per device type: the ops
# with device kernels that beat what Inductor generates from their ATen reference. Measured
# on SmolLM2's block package (decode, one block's weights called over and over, 1 thread,
# CPU time per call): fxc::linear + fxc::paged_attention kept 640 us, every fxc op kept
# 670 us, all rewritten to ATen 2160 us (the references unpack the prepacked weights and
# gather the paged context on every call); keeping rms_norm, silu_mul or rope as well ties
# (647-654 us): Inductor fuses their references with their neighbours (rms_norm with the
# residual add, rope with the q/k split) and an extern call of what was then a Python-registered
# kernel cost ~2 us more than a fused loop (the CPU kernels are registered from C++ since; not
# re-measured). CUDA has no fxc kernels: everything is ATen there.
# fxc::linear_f8 (fp8 weights, upcast in the kernel) is kept on CPU like linear_w8: its reference would upcast
# and scale the whole weight on every call.
# fxc::linear_w4 (int4 weights dequantised in the kernel), fxc::linear_w8a8 and fxc::linear_w4a8 likewise (their
# references unpack the weight and run integer matmuls on every call), and fxc::linear_f8f8 (one C++ kernel: the
# per-token e4m3 rows and linear_f8's matmul).
EXTERN_OPS: dict[str, tuple[str, ...]] = {"cpu": ("linear", "linear_w8", "linear_w4", "linear_f8", "linear_w8a8",
                                                  "linear_w4a8", "linear_f8f8", "linear_by_m", "paged_attention")}

# Inductor options the packages are compiled with (part of the package key).
# ``cpp.threads=1``: Inductor's own loops (the elementwise/reduction code around the extern
# calls) are generated serial; the fxc kernels and ATen's mm keep their threads. Without it
# the generated code depends on the compiling process's thread count (``#pragma omp parallel``
# when it equals the core count, else ``num_threads(n)`` hard-coded), and at decode every
# such region is a fork/join over a few hundred elements. Measured on SmolLM2's b1 pipelines
# (2 threads, shared VM with the other core often busy; serial vs parallel): decode step min
# 22.5 / 21.1 vs 21.0 / 21.2 ms, median 27.1 / 30.4 vs 220 / 29.3 ms in two runs, the
# embedding package alone 0.05 vs 1.8-2.9 ms a step; prefill of 256 tokens min 362 vs 400 ms.
INDUCTOR_OPTIONS: dict[str, Any] = {"cpp.threads": 1}


def extern_ops(device: torch.device | str = "cpu") -> tuple[str, ...]:
    """Names of the ``fxc`` ops that packages compiled for ``device``'s kind keep as calls into
    the op (see :data:`EXTERN_OPS`); the others are rewritten to their ATen references."""
    return EXTERN_OPS.get(torch.device(device).type, ())


def _references(keep: tuple[str, ...] | frozenset[str] = ()) -> dict[Any, Any]:
    import fxcompiler.ops  # noqa: F401  (registers the fxc namespace)

    fused = importlib.import_module("fxcompiler.ops.fused")
    pa = importlib.import_module("fxcompiler.ops.paged_attention")
    lin = importlib.import_module("fxcompiler.ops.linear")
    qlin = importlib.import_module("fxcompiler.ops.quant_linear")
    moe = importlib.import_module("fxcompiler.ops.moe")
    w8a8 = importlib.import_module("fxcompiler.ops.w8a8_linear")
    w4a8 = importlib.import_module("fxcompiler.ops.w4a8_linear")
    f8lin = importlib.import_module("fxcompiler.ops.f8_linear")
    qemb = importlib.import_module("fxcompiler.ops.quant_embedding")
    ops = torch.ops.fxc
    # The fused q/k/v attention becomes ATen head views + the rope reference (Inductor fuses them
    # with their neighbours) around the attention op, kept or itself rewritten like a lone one.
    return {
        ops.qkv_paged_attention.default: (_qkv_attention_calling_the_op if "paged_attention" in keep
                                          else _qkv_attention_aten),
        ops.paged_attention.default: pa.paged_attention_reference,
        ops.rms_norm.default: fused.rms_norm_reference,
        ops.silu_mul.default: fused.silu_mul_reference,
        ops.rope.default: fused.rope_reference,
        ops.linear.default: lin.linear_reference,
        ops.linear_w8.default: lin.linear_w8_reference,
        ops.linear_f8.default: qlin.linear_f8_reference,
        ops.linear_w8a8.default: w8a8.linear_w8a8_reference,
        ops.linear_w4a8.default: w4a8.linear_w4a8_reference,
        # the fused gated MLP: the kept fxc::linear_w4a8 and silu_mul's reference (Inductor fuses it)
        ops.linear_w4a8_silu_mul.default: (_linear_w4a8_silu_mul_calling_the_op if "linear_w4a8" in keep
                                           else w4a8.linear_w4a8_silu_mul_aten),
        ops.linear_w4a8_add.default: (w4a8.linear_w4a8_add_reference if "linear_w4a8" in keep  # calls the op
                                      else w4a8.linear_w4a8_add_aten),
        ops.linear_w4.default: qlin.linear_w4_reference,
        ops.linear_w4_silu_mul.default: (_linear_w4_silu_mul_calling_the_op if "linear_w4" in keep
                                         else qlin.linear_w4_silu_mul_aten),
        ops.linear_w4_add.default: (qlin.linear_w4_add_reference if "linear_w4" in keep  # calls the op
                                    else qlin.linear_w4_add_aten),
        ops.linear_w8_silu_mul.default: (_linear_w8_silu_mul_calling_the_op if "linear_w8" in keep
                                         else lin.linear_w8_silu_mul_aten),
        ops.linear_w8_add.default: (lin.linear_w8_add_reference if "linear_w8" in keep  # calls the op
                                    else lin.linear_w8_add_aten),
        ops.linear_f8f8.default: f8lin.linear_f8f8_composite,  # row quantization inlined, linear_f8 kept
        ops.linear_by_m.default: lin.linear_by_m_dense,
        ops.linear_add.default: lin.linear_add_reference if "linear" in keep else lin.linear_add_aten,
        ops.linear_by_m_add.default: (lin.linear_by_m_add_reference if "linear_by_m" in keep  # calls the op
                                      else lin.linear_by_m_add_dense),
        ops.moe.default: moe.moe_reference,  # the batched gather of the selected experts, inlined
        ops.embedding_w8.default: qemb.embedding_w8_reference,  # only the gathered rows dequantised
        ops.embedding_w4.default: qemb.embedding_w4_reference,
    }


def _linear_w4a8_silu_mul_calling_the_op(x, w, scales, mins, bias, n, group_size):
    """``fxc::linear_w4a8_silu_mul`` as a kept ``fxc::linear_w4a8`` and ``fxc::silu_mul``'s reference."""
    from .ops.fused import silu_mul_reference

    gate, up = torch.ops.fxc.linear_w4a8.default(x, w, scales, mins, bias, n, group_size).split(n // 2, dim=-1)
    return silu_mul_reference(gate, up)


def _linear_w4_silu_mul_calling_the_op(x, w, scales, mins, bias, n, group_size):
    """``fxc::linear_w4_silu_mul`` as a kept ``fxc::linear_w4`` and ``fxc::silu_mul``'s reference."""
    from .ops.fused import silu_mul_reference

    gate, up = torch.ops.fxc.linear_w4.default(x, w, scales, mins, bias, n, group_size).split(n // 2, dim=-1)
    return silu_mul_reference(gate, up)


def _linear_w8_silu_mul_calling_the_op(x, w, scales, bias, n, group_size):
    """``fxc::linear_w8_silu_mul`` as a kept ``fxc::linear_w8`` and ``fxc::silu_mul``'s reference."""
    from .ops.fused import silu_mul_reference

    gate, up = torch.ops.fxc.linear_w8.default(x, w, scales, bias, n, group_size).split(n // 2, dim=-1)
    return silu_mul_reference(gate, up)


def _qkv_attention_calling_the_op(qkv, cos, sin, *args):
    """``fxc::qkv_paged_attention`` as ATen head views and rope around a kept ``fxc::paged_attention``."""
    from .ops.fused import rope_reference
    from .ops.paged_attention import qkv_paged_attention_reference

    return qkv_paged_attention_reference(qkv, cos, sin, *args, rope=rope_reference,
                                         attention=torch.ops.fxc.paged_attention.default)


def _qkv_attention_aten(qkv, cos, sin, *args):
    """``fxc::qkv_paged_attention`` in ATen ops only (the rope and attention references)."""
    from .ops.fused import rope_reference
    from .ops.paged_attention import paged_attention_reference, qkv_paged_attention_reference

    return qkv_paged_attention_reference(qkv, cos, sin, *args, rope=rope_reference,
                                         attention=paged_attention_reference)


def aten_graph_module(gm: torch.fx.GraphModule, keep: tuple[str, ...] | frozenset[str] = ()) -> torch.fx.GraphModule:
    """A copy of ``gm`` whose ``fxc::*`` nodes call their ATen references (Python functions
    that export traces to ATen ops), except the ops named in ``keep`` (e.g. ``"linear"``),
    which stay calls into the op. Raises ``EdfCompileError`` for an fxc op that is neither
    kept nor has a reference."""
    refs = _references(keep)
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        is_fxc = isinstance(target, torch._ops.OpOverload) and target.namespace == "fxc"
        if is_fxc and target._schema.name.split("::", 1)[1] in keep:
            continue
        if target in refs:
            node.target = refs[target]
        elif is_fxc:
            raise EdfCompileError(f"edf: graph node {node.name!r} calls {target}, which has no ATen reference "
                                  "that AOTInductor could compile")
    return torch.fx.GraphModule(gm, graph, class_name="EdfAtenGraph")


# --------------------------------------------------------------------------- export


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in phs:
        if not isinstance(n.meta.get("val"), torch.Tensor):
            raise EdfCompileError(f"edf: placeholder {n.name!r} has no tensor meta['val'] (restore the blob's "
                                  "meta with fxcompiler.graph_io.restore_meta first); only tensor inputs compile")
    return phs


def _symbol(dim) -> str | None:
    if isinstance(dim, torch.SymInt):
        expr = dim.node.expr
        if not getattr(expr, "is_Integer", False):
            return str(expr)
    return None


def export_inputs(gm: torch.fx.GraphModule, device: torch.device, auto: bool = False):
    """Example inputs (zeros, every symbolic dim at least 2 so export does not specialise it)
    and ``dynamic_shapes`` for :func:`torch.export.export` from the placeholders' ``meta['val']``.
    A placeholder dim that is a plain symbol becomes the named ``Dim`` of that symbol (shared by
    every input that has it); one that is an expression, or every symbolic dim with ``auto``,
    becomes ``Dim.AUTO``."""
    from torch.export import Dim

    dims: dict[str, Any] = {}
    args, shapes = [], []
    for n in _placeholders(gm):
        val = n.meta["val"]
        shape, spec = [], {}
        for i, d in enumerate(val.shape):
            name = _symbol(d)
            if name is None:
                shape.append(int(d))
                continue
            hint = d.node.hint if hasattr(d.node, "hint") else None
            shape.append(max(2, int(hint)) if isinstance(hint, int) else 2)
            if auto or not name.isidentifier():
                spec[i] = Dim.AUTO
            else:
                spec[i] = dims.setdefault(name, Dim(name, min=1))
        args.append(torch.zeros(shape, dtype=val.dtype, device=device))
        shapes.append(spec or None)
    return tuple(args), tuple(shapes)


def _export(gm: torch.fx.GraphModule, device: torch.device, keep: tuple[str, ...]):
    aten = aten_graph_module(gm, keep)
    args, shapes = export_inputs(gm, device)
    try:
        return torch.export.export(aten, args, dynamic_shapes=shapes, strict=False)
    except torch._dynamo.exc.UserError:
        # Named dims the trace relates to each other (a guard export wants expressed): let it infer.
        args, shapes = export_inputs(gm, device, auto=True)
        return torch.export.export(aten, args, dynamic_shapes=shapes, strict=False)


# --------------------------------------------------------------------------- keys and compilation


def _sources_fingerprint() -> str:
    h = hashlib.sha256()
    for name in (__name__, *_REF_MODULES):
        mod = importlib.import_module(name)
        h.update(name.encode())
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()


def _canonical_dim(dim, symbols: dict) -> str:
    """``dim`` as text with its symbols renamed ``d0, d1, ...`` in order of first appearance
    (``symbols`` carries the renaming across a graph's placeholders)."""
    if not isinstance(dim, torch.SymInt):
        return str(int(dim))
    import sympy

    expr = dim.node.expr
    for sym in sorted(expr.free_symbols, key=str):
        symbols.setdefault(sym, sympy.Symbol(f"d{len(symbols)}", integer=True, positive=True))
    return str(expr.xreplace({sym: symbols[sym] for sym in expr.free_symbols}))


def package_key(gm: torch.fx.GraphModule, device: torch.device | str = "cpu",
                extern: tuple[str, ...] | None = None) -> str:
    """Content key of the package compiled from ``gm`` for ``device``'s kind (sha256 hex): graph
    code, placeholder shapes/dtypes, constants, device kind, the fxc ops kept as calls
    (``extern``, default :func:`extern_ops`), the Inductor options, torch version, this module's
    and the op references' sources."""
    from .graph_io import graph_constants, graph_module_source, load_graph_module

    extern = extern_ops(device) if extern is None else tuple(extern)
    h = hashlib.sha256()
    h.update(f"{FORMAT}\nedf\n{torch.__version__}\n{torch.device(device).type}\n".encode())
    h.update(f"extern={','.join(sorted(extern))}\ninductor={sorted(INDUCTOR_OPTIONS.items())}\n".encode())
    h.update(_sources_fingerprint().encode())
    # The code of the graph as loading it back gives it (node names are re-derived by the
    # tracer), so a graph rebuilt from an artifact's fx source has the key of the original.
    h.update(graph_module_source(load_graph_module(graph_module_source(gm), graph_constants(gm))).encode())
    # Symbolic dims by order of first appearance, not by name: the symbols of a graph whose meta
    # was re-derived (compile/build cache hits, artifacts) have other names for the same dims.
    symbols: dict[Any, Any] = {}
    for n in _placeholders(gm):
        v = n.meta["val"]
        h.update(f"{n.name}:{v.dtype}:{[_canonical_dim(d, symbols) for d in v.shape]}\n".encode())
    for name, t in sorted(graph_constants(gm).items()):
        h.update(f"{name}:{t.dtype}:{list(t.shape)}\n".encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _check_compiler() -> None:
    """Raise :class:`EdfCompileError` unless AOTInductor finds a C++ compiler here."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # another torch layout: look for the usual names ourselves
        get_cpp_compiler = None
    hint = "Install g++ (or point CXX / torch._inductor.config.cpp.cxx at one), or use comp_supertask_kind='fx'"
    if get_cpp_compiler is not None:
        try:
            cxx = get_cpp_compiler()
        except Exception as exc:  # torch raises InvalidCxxCompiler when it finds none
            raise EdfCompileError(f"edf supertasks need a C++ compiler for AOTInductor; none found "
                                  f"({type(exc).__name__}: {str(exc).strip()[:300]}). {hint}") from exc
    else:
        cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None and not os.path.isfile(cxx):
        raise EdfCompileError(f"edf supertasks need a C++ compiler for AOTInductor; {cxx!r} is not on PATH. {hint}")


def _temp_beside(path: Path) -> Path:
    """A temporary name beside ``path`` for an atomic write: ``.tmp-<pid>-<name>``, the form
    :func:`~fxcompiler.integrity.remove_stale_temps` removes once its writer is gone (left behind when a
    writer is killed mid-compilation), which it is asked to do here first."""
    from .integrity import remove_stale_temps

    remove_stale_temps(path.parent, ".tmp-")
    return path.with_name(f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-{path.name}")


def compile_package(gm: torch.fx.GraphModule, path: str | os.PathLike, device: torch.device | str = "cpu",
                    *, name: str = "", extern: tuple[str, ...] | None = None) -> Path:
    """Export ``gm`` (the fxc ops named in ``extern`` — default :func:`extern_ops` — kept as
    calls, the others as ATen references; weights as inputs, dynamic dims) and compile it with
    AOTInductor into the package file ``path`` (written atomically)."""
    _check_compiler()
    device = torch.device(device)
    extern = extern_ops(device) if extern is None else tuple(extern)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    label = name or path.stem
    try:
        ep = _export(gm, device, extern)
    except EdfCompileError:
        raise
    except Exception as exc:
        raise EdfCompileError(f"edf: torch.export of blob {label} failed: {type(exc).__name__}: {exc}") from exc
    tmp = _temp_beside(path)
    try:
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp),
                                                 inductor_configs=dict(INDUCTOR_OPTIONS) or None)
        os.replace(tmp, path)
        _record(path)
    except Exception as exc:
        tmp.unlink(missing_ok=True)
        raise EdfCompileError(f"edf: AOTInductor compilation of blob {label} failed: "
                              f"{type(exc).__name__}: {str(exc)[:2000]}") from exc
    return path


def _default_cache_dir() -> Path:
    """Packages of a conversion without a cache_dir: a process-lifetime temporary directory."""
    from .integrity import process_temp_dir

    return process_temp_dir("fxcompiler-edf-")


def package_dir(cache_dir: str | os.PathLike | None) -> Path:
    """Where packages live: ``<cache_dir>/edf``."""
    return (Path(cache_dir) if cache_dir is not None else _default_cache_dir()) / "edf"


def _check_fx_blob(blob: DataBlob) -> None:
    if blob.kind != "fx" or not isinstance(blob.graph, torch.fx.GraphModule):
        raise ValueError(f"blob {blob.id} is a {blob.kind!r} blob holding {type(blob.graph).__name__}; "
                         "to_edf converts fx blobs with their GraphModule")


def _package_path(blob: DataBlob, cache_dir, device: torch.device) -> tuple[str, Path]:
    key = package_key(blob.graph, device)
    return key, package_dir(cache_dir) / f"{key}{PACKAGE_SUFFIX}"


def _edf_blob(key: str, path: Path, device: torch.device) -> DataBlob:
    return DataBlob(key[:20], "edf", EdfPackage(str(path), key, device.type))


def to_edf_blob(blob: DataBlob, cache_dir: str | os.PathLike | None, device: torch.device | str = "cpu",
                stats: dict | None = None) -> DataBlob:
    """The edf DataBlob of an fx blob: its package from ``<cache_dir>/edf/<key>.pt2``, compiled
    there first when missing. ``stats`` (optional) counts ``compiled``/``cached`` and sums
    ``compile_s``."""
    _check_fx_blob(blob)
    device = torch.device(device)
    key, path = _package_path(blob, cache_dir, device)
    if path.is_file() and not package_is_intact(path):
        import logging

        logging.getLogger("fxcompiler.cache").warning(
            "edf package %s does not match its recorded checksum (or has none); removing and recompiling it", path)
        path.unlink(missing_ok=True)
    if path.is_file():
        _count(stats, "cached")
        if cache_dir is not None:
            from .cache_limits import mark_used

            mark_used(path)  # recency for the cache size limit
    else:
        t0 = time.perf_counter()
        compile_package(blob.graph, path, device, name=f"fx:{blob.id}")
        _count(stats, "compiled", time.perf_counter() - t0)
    return _edf_blob(key, path, device)


def _count(stats: dict | None, what: str, seconds: float = 0.0) -> None:
    if stats is not None:
        stats[what] = stats.get(what, 0) + 1
        stats["compile_s"] = stats.get("compile_s", 0.0) + seconds


def _device_of(pipeline: Pipeline, task) -> torch.device:
    dev = pipeline.devices.get(task.device) if task.device is not None else None
    if dev is None and len(set(pipeline.devices.values())) == 1:
        dev = next(iter(pipeline.devices.values()))
    return torch.device("cpu" if dev is None else str(dev))


def _fx_tasks(pipeline: Pipeline) -> list:
    return [t for t in pipeline.supertasks.values() if t.kind is SuperTaskKind.FX]


def _target_device(pipeline: Pipeline, device) -> torch.device:
    fx_tasks = _fx_tasks(pipeline)
    return torch.device(device) if device is not None else (
        _device_of(pipeline, fx_tasks[0]) if fx_tasks else torch.device("cpu"))


def to_edf_pipeline(pipeline: Pipeline, cache_dir: str | os.PathLike | None,
                    cache: dict[tuple[str, str], DataBlob] | None = None, *,
                    device: torch.device | str | None = None, stats: dict | None = None) -> Pipeline:
    """``pipeline`` with every fx compute supertask turned into an edf one (see :func:`to_edf_blob`).

    ``cache``: (fx blob id, device type) → edf DataBlob, shared by a model's pipelines so each
    unique blob is compiled (or looked up) once. ``device``: what to compile for (default: the
    supertask's device in ``pipeline.devices``, else CPU). Non-fx supertasks, tensors, params and
    metadata are kept (copied)."""
    cache = {} if cache is None else cache
    dev = _target_device(pipeline, device)

    def convert(blob: DataBlob) -> DataBlob:
        if (blob.id, dev.type) not in cache:
            cache[(blob.id, dev.type)] = to_edf_blob(blob, cache_dir, dev, stats)
        return cache[(blob.id, dev.type)]

    return retarget_compute_supertasks(pipeline, SuperTaskKind.FX, SuperTaskKind.EDF, convert)


def to_edf_pipelines(pipelines: list[Pipeline], cache_dir: str | os.PathLike | None, *,
                     device: torch.device | str | None = None, stats: dict | None = None,
                     num_workers: int = 1) -> list[Pipeline]:
    """:func:`to_edf_pipeline` over a model's pipelines, compiling each shared blob once
    (packages under ``<cache_dir>/edf``; ``cache_dir=None``: a temporary directory for this
    process). Raises :class:`EdfCompileError` when a blob cannot be compiled (e.g. no C++
    compiler).

    ``num_workers > 1``: the packages that are not in the cache yet are compiled in up to that
    many worker processes at once (:func:`compile_packages_in_workers`); 1 compiles them one
    after the other in this process."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
    cache: dict[tuple[str, str], DataBlob] = {}
    if num_workers > 1:
        cache = _prepare_in_workers(pipelines, cache_dir, device, stats, num_workers)
    return [to_edf_pipeline(p, cache_dir, cache, device=device, stats=stats) for p in pipelines]


# --------------------------------------------------------------------------- parallel compilation


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """What a worker process needs to compile one package: the blob's graph as code (see
    :mod:`fxcompiler.graph_io`), its constants (``torch.save`` bytes), its placeholder signature
    (to restore ``meta['val']``), the target device kind, the fxc ops kept as calls, and the
    package path (written atomically by the worker)."""

    name: str
    source: str
    constants: bytes
    signature: dict
    device: str
    extern: tuple[str, ...]
    path: str


def compile_job(blob: DataBlob, path: str | os.PathLike, device: torch.device | str = "cpu") -> CompileJob | None:
    """The :class:`CompileJob` of an fx blob, or None when its graph cannot travel as code (a
    placeholder with a compound symbolic dim has no signature to restore its meta from)."""
    import io

    from .graph_io import graph_constants, graph_module_source, placeholder_signature

    _check_fx_blob(blob)
    signature = placeholder_signature(blob.graph)
    if signature is None:
        return None
    buf = io.BytesIO()
    torch.save({k: v.contiguous() for k, v in graph_constants(blob.graph).items()}, buf)
    device = torch.device(device)
    return CompileJob(f"fx:{blob.id}", graph_module_source(blob.graph), buf.getvalue(), signature, str(device),
                      extern_ops(device), str(path))


def run_compile_job(job: CompileJob) -> float:
    """Worker entry point: rebuild the blob's GraphModule from the job and compile its package
    to ``job.path``; returns the seconds it took (graph load included)."""
    import io

    from .graph_io import load_graph_module, restore_meta

    t0 = time.perf_counter()
    constants = torch.load(io.BytesIO(job.constants), weights_only=True)
    gm = load_graph_module(job.source, constants)
    restore_meta(gm, job.signature)
    compile_package(gm, job.path, job.device, name=job.name, extern=job.extern)
    return time.perf_counter() - t0


def check_spawn_safe() -> None:
    """Raise :class:`EdfCompileError` when called while a spawned worker process is importing
    the main module: a script that builds an LLM with ``num_compile_workers > 1`` at import
    time (no ``if __name__ == "__main__":``) would otherwise build it again in every compile
    worker, and each of those would try to start workers of its own."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise EdfCompileError(_GUARD_HINT)


_GUARD_HINT = ("edf compile workers are spawned processes that import the main module: build the LLM with "
               "num_compile_workers > 1 under `if __name__ == \"__main__\":` in a script (or use num_compile_workers=1)")


def _worker_init() -> None:
    torch.set_num_threads(1)  # each worker compiles one package at a time; g++ is single-threaded anyway


def compile_packages_in_workers(jobs: list[CompileJob], num_workers: int) -> list[float]:
    """Run compile jobs in a pool of ``min(num_workers, len(jobs))`` worker processes (``spawn``
    start method: nothing of this process, threads included, is inherited; each worker imports
    torch and fxcompiler itself, ~2-4 s). Returns each job's seconds, in order; the first
    failure is raised as :class:`EdfCompileError` (packages already written stay in the cache).

    As with any ``spawn`` pool, a script that builds an LLM with ``num_compile_workers > 1``
    at import time must do so under ``if __name__ == "__main__":`` (the workers import the
    main module)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    if not jobs:
        return []
    check_spawn_safe()
    _check_compiler()  # fail here, with the clear message, rather than once per worker
    ctx = multiprocessing.get_context("spawn")
    workers = min(num_workers, len(jobs))
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init) as pool:
            # longest first (transformer blocks), so the small blobs fill the other workers
            order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i].source))
            futures = {i: pool.submit(run_compile_job, jobs[i]) for i in order}
            return [futures[i].result() for i in range(len(jobs))]
    except BrokenProcessPool as exc:
        raise EdfCompileError(f"edf: a compile worker process died ({exc}). If the main script builds the LLM at "
                              f"import time, that is why: {_GUARD_HINT}") from exc


def _prepare_in_workers(pipelines: list[Pipeline], cache_dir, device, stats: dict | None,
                        num_workers: int) -> dict[tuple[str, str], DataBlob]:
    """The (fx blob id, device type) → edf DataBlob map of every unique fx blob of
    ``pipelines``, the missing packages compiled in worker processes (blobs that cannot travel
    as code are compiled here, one after the other)."""
    unique: dict[tuple[str, str], tuple[DataBlob, torch.device]] = {}
    for p in pipelines:
        dev = _target_device(p, device)
        for task in _fx_tasks(p):
            blob = p.blobs[task.data_blob]
            unique.setdefault((blob.id, dev.type), (blob, dev))
    cache: dict[tuple[str, str], DataBlob] = {}
    jobs: list[CompileJob] = []
    for ident, (blob, dev) in unique.items():
        _check_fx_blob(blob)
        key, path = _package_path(blob, cache_dir, dev)
        cache[ident] = _edf_blob(key, path, dev)
        if path.is_file() and not package_is_intact(path):
            path.unlink(missing_ok=True)  # damaged or unrecorded: recompiled below
        if path.is_file():
            _count(stats, "cached")
            continue
        job = compile_job(blob, path, dev)
        if job is None:
            cache[ident] = to_edf_blob(blob, cache_dir, dev, stats)
        else:
            jobs.append(job)
    if jobs:
        path = Path(jobs[0].path)
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        seconds = compile_packages_in_workers(jobs, num_workers)
        for s in seconds:
            _count(stats, "compiled", s)
        if stats is not None:
            stats["workers"] = min(num_workers, len(jobs))
            stats["parallel_wall_s"] = stats.get("parallel_wall_s", 0.0) + time.perf_counter() - t0
    for ident, blob in cache.items():
        if not Path(blob.graph.path).is_file():  # pragma: no cover - a worker returned without writing
            raise EdfCompileError(f"edf: the worker compiling fx blob {ident[0]} wrote no package {blob.graph.path}")
    return cache


def extern_kernel_calls(path: str | os.PathLike) -> list[str]:
    """The ops a package calls as extern (fallback) kernels through the proxy executor, in call
    order (e.g. ``["fxc::linear", "fxc::paged_attention", ...]``), read from the extern-kernel
    JSON that AOTInductor writes next to the generated code in the package."""
    import json
    import zipfile

    calls: list[str] = []
    with zipfile.ZipFile(path) as zf:
        for name in sorted(zf.namelist()):
            if name.endswith(".json") and "/data/aotinductor/" in name and not name.endswith("_metadata.json"):
                doc = json.loads(zf.read(name))
                if isinstance(doc, dict) and isinstance(doc.get("nodes"), list):
                    calls += [n["node"]["target"] for n in doc["nodes"]]
    return calls



# --------------------------------------------------------------------------- artifacts


def serialize(package: EdfPackage) -> bytes:
    """Bytes of an edf blob's package (the ``.pt2`` zip) for artifacts."""
    return package.read_bytes()


def deserialize(data: bytes, key: str, cache_dir: str | os.PathLike | None = None,
                device_type: str = "cpu") -> EdfPackage:
    """An :class:`EdfPackage` from :func:`serialize` bytes: written to ``<cache_dir>/edf/<key>.pt2``.
    ``key`` must be a sha256 hex digest (it names a file; nothing else may). A package already
    there is kept only when its bytes are these bytes; a different one is replaced (the
    artifact's own package is what was verified)."""
    check_key(key)
    path = package_dir(cache_dir) / f"{key}{PACKAGE_SUFFIX}"
    digest = hashlib.sha256(data).hexdigest()
    if path.is_file() and not path.is_symlink() and _sha256_of(path) == digest:
        return EdfPackage(str(path), key, device_type)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_beside(path)
    tmp.write_bytes(data)
    os.replace(tmp, path)
    _record(path)
    return EdfPackage(str(path), key, device_type)


def check_key(key: Any) -> str:
    """A package key: 64 lowercase hex digits (a file name inside ``<cache_dir>/edf``, never a path)."""
    if not isinstance(key, str) or len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise ValueError(f"edf package key must be a sha256 hex digest, got {key!r}")
    return key


def _sha256_of(path: Path) -> str:
    from .integrity import sha256_file

    return sha256_file(path)


def _record(path: Path) -> None:
    """Write ``<key>.pt2.sha256`` beside a package: its content checksum, verified before loading."""
    path.with_name(path.name + ".sha256").write_text(_sha256_of(path))


def package_is_intact(path: str | os.PathLike) -> bool:
    """Whether the cached package ``path`` matches the checksum recorded beside it (a package
    without one, or a symlink, is not trusted)."""
    path = Path(path)
    rec = path.with_name(path.name + ".sha256")
    if path.is_symlink() or not path.is_file() or not rec.is_file():
        return False
    return rec.read_text().strip() == _sha256_of(path)
