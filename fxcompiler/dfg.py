"""``dfg`` supertasks: a compute graph as an ONNX ``ModelProto`` (DESIGN §5).

:func:`fx_to_onnx` writes an ATen-level ``torch.fx`` graph as a standard dataflow graph
that ``onnx.checker`` accepts and Netron displays, one ONNX node per fx ``call_function``
node, with our ops in custom domains:

* ``torch.ops.<ns>.<op>.<overload>`` → domain ``<ns>`` (``aten``, ``fxc``...), op_type
  ``<op>.<overload>`` (``mm.default``, ``paged_attention.default``);
* Python ``operator`` functions (``getitem`` on tuples, arithmetic on SymInts) → domain
  ``fx.builtin``, op_type the function name; other Python callables → domain ``fx.python``,
  op_type ``<module>.<qualname>``; ``call_method`` nodes → domain ``fx.method``.

The node's inputs are the tensors (values of other nodes) its arguments reference, its one
output is the fx node's value (a tuple-valued node, e.g. ``split_with_sizes``, has one output
that ``fx.builtin::getitem`` nodes read). The full argument structure is the string
attribute ``args`` (and ``kwargs`` when there are any): JSON in which a value reference is
``{"$ref": name}`` and non-JSON constants are tagged (``{"$dtype": "float32"}``,
``{"$tuple": [...]}``, ``{"$float": "inf"}``, devices, memory formats, layouts, slices), so
the encoding round-trips exactly. Placeholders are graph inputs (element type and shape from
``meta['val']``, symbolic dims as ``dim_param``; non-tensor or unknown values get the opaque
type ``fx.builtin::SymInt``/``unknown``), ``get_attr`` constants are initializers, the output
node's values are graph outputs. ``metadata_props`` keep what ONNX has no place for (fx node
order, placeholder and constant targets, output structure, shape hints), so
:func:`onnx_to_fx` rebuilds the same graph: same nodes, names and targets, hence the same
generated code and bit-identical results.

:func:`to_dfg_pipeline` turns a built fx :class:`~fxcompiler.pipeline.Pipeline` into a dfg one;
``backends/dfg.py`` executes it. :func:`dfg_graph`, :func:`liveness` and :func:`critical_path`
are ``networkx``-based analyses. A blob serialises with :func:`serialize` /
:func:`deserialize` (``ModelProto.SerializeToString`` / ``onnx.load_from_string``).
"""
from __future__ import annotations

import hashlib
import importlib
import json
import math
import operator
from typing import Any

import onnx
import torch

from .pipeline import DataBlob, Pipeline, SuperTaskKind, retarget_compute_supertasks

FORMAT = "fxcompiler-dfg/1"
BUILTIN_DOMAIN = "fx.builtin"
PYTHON_DOMAIN = "fx.python"
METHOD_DOMAIN = "fx.method"
_META_PREFIX = "fxc."

_DTYPES = {
    torch.float32: onnx.TensorProto.FLOAT, torch.float64: onnx.TensorProto.DOUBLE,
    torch.float16: onnx.TensorProto.FLOAT16, torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.int64: onnx.TensorProto.INT64, torch.int32: onnx.TensorProto.INT32,
    torch.int16: onnx.TensorProto.INT16, torch.int8: onnx.TensorProto.INT8,
    torch.uint8: onnx.TensorProto.UINT8, torch.bool: onnx.TensorProto.BOOL,
    torch.complex64: onnx.TensorProto.COMPLEX64, torch.complex128: onnx.TensorProto.COMPLEX128,
    torch.float8_e4m3fn: onnx.TensorProto.FLOAT8E4M3FN, torch.float8_e5m2: onnx.TensorProto.FLOAT8E5M2,
    torch.uint16: onnx.TensorProto.UINT16, torch.uint32: onnx.TensorProto.UINT32,
    torch.uint64: onnx.TensorProto.UINT64,
}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}


# --------------------------------------------------------------------------- argument encoding


def _encode(value: Any, refs: dict[str, None]) -> Any:
    """JSON-able form of an fx argument; node references are collected into ``refs`` (ordered)."""
    if isinstance(value, torch.fx.Node):
        refs.setdefault(value.name, None)
        return {"$ref": value.name}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, refs) for v in value]}
    if isinstance(value, list):
        return [_encode(v, refs) for v in value]
    if isinstance(value, dict):
        return {"$dict": [[_encode(k, refs), _encode(v, refs)] for k, v in value.items()]}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, torch.memory_format):
        return {"$memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {"$layout": str(value).removeprefix("torch.")}
    if isinstance(value, slice):
        return {"$slice": [_encode(value.start, refs), _encode(value.stop, refs), _encode(value.step, refs)]}
    if value is Ellipsis:
        return {"$ellipsis": True}
    if isinstance(value, complex):
        return {"$complex": [repr(value.real), repr(value.imag)]}
    raise TypeError(f"cannot encode an fx argument of type {type(value).__name__} ({value!r}) as an ONNX attribute")


def _decode(value: Any, env: dict[str, Any]) -> Any:
    if isinstance(value, list):
        return [_decode(v, env) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1:
        raise ValueError(f"malformed dfg argument encoding {value!r}")
    (tag, v), = value.items()
    if tag == "$ref":
        return env[v]
    if tag == "$tuple":
        return tuple(_decode(x, env) for x in v)
    if tag == "$float":
        return float(v)
    if tag == "$dict":
        return {_decode(k, env): _decode(x, env) for k, x in v}
    if tag == "$dtype":
        return getattr(torch, v)
    if tag == "$device":
        return torch.device(v)
    if tag in ("$memory_format", "$layout"):
        return getattr(torch, v)
    if tag == "$slice":
        return slice(*(_decode(x, env) for x in v))
    if tag == "$ellipsis":
        return Ellipsis
    if tag == "$complex":
        return complex(float(v[0]), float(v[1]))
    raise ValueError(f"unknown dfg argument tag {tag!r}")


# --------------------------------------------------------------------------- targets


def _op_identity(node: torch.fx.Node) -> tuple[str, str]:
    """(domain, op_type) of an fx call node."""
    target = node.target
    if node.op == "call_method":
        return METHOD_DOMAIN, str(target)
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace, f"{target._opname}.{target._overloadname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        ns, name = target._qualified_op_name.split("::")
        return ns, name
    if isinstance(target, torch._ops.HigherOrderOperator):
        return "higher_order", target.__name__
    module = getattr(target, "__module__", None)
    name = getattr(target, "__name__", None)
    if module in ("_operator", "operator") and getattr(operator, name, None) is target:
        return BUILTIN_DOMAIN, name
    qualname = getattr(target, "__qualname__", name)
    if module and qualname and _resolve_python(f"{module}.{qualname}") is target:
        return PYTHON_DOMAIN, f"{module}.{qualname}"
    raise TypeError(f"fx node {node.name!r} calls {target!r}, which has no importable name")


def _resolve_python(path: str):
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for p in parts[i:]:
                obj = getattr(obj, p)
            return obj
        except AttributeError:
            return None
    return None


# What a dfg graph read from a file may call (verify, then execute: an ONNX file names its ops
# as strings, and resolving any importable dotted name would let a file call anything).
OP_DOMAINS = frozenset({"aten", "fxc", "prims"})
PYTHON_ALLOWED_PREFIXES = ("math.", "torch.sym_", "torch._sym_", "torch.fx.experimental.sym_node.",
                           "fxcompiler.ops.", "torch._refs.", "torch.functional.")
_BUILTIN_DENIED = frozenset({"attrgetter", "itemgetter", "methodcaller", "call"})


class DisallowedOpError(ValueError):
    """A dfg node names an op outside the allow-list (:data:`OP_DOMAINS`, fx builtins/methods,
    :data:`PYTHON_ALLOWED_PREFIXES`)."""


def _resolve_target(domain: str, op_type: str):
    if domain == METHOD_DOMAIN:
        if not op_type.isidentifier() or op_type.startswith("_"):
            raise DisallowedOpError(f"dfg node calls method {op_type!r}: only public tensor methods are allowed")
        return "call_method", op_type
    if domain == BUILTIN_DOMAIN:
        if not op_type.isidentifier() or op_type.startswith("_") or op_type in _BUILTIN_DENIED \
                or not hasattr(operator, op_type):
            raise DisallowedOpError(f"dfg node calls operator.{op_type}, which is not an allowed builtin op")
        return "call_function", getattr(operator, op_type)
    if domain == PYTHON_DOMAIN:
        if not op_type.startswith(PYTHON_ALLOWED_PREFIXES) or not all(p.isidentifier() for p in op_type.split(".")):
            raise DisallowedOpError(f"dfg node calls the Python function {op_type!r}, outside the allow-list "
                                    f"{PYTHON_ALLOWED_PREFIXES}")
        obj = _resolve_python(op_type)
        if obj is None:
            raise ValueError(f"dfg node calls {op_type!r}, which does not import here")
        return "call_function", obj
    if domain == "higher_order":
        if not op_type.isidentifier() or op_type.startswith("_") or not hasattr(torch.ops.higher_order, op_type):
            raise DisallowedOpError(f"dfg node calls higher-order op {op_type!r}, which is not registered")
        return "call_function", getattr(torch.ops.higher_order, op_type)
    if domain not in OP_DOMAINS:
        raise DisallowedOpError(f"dfg node calls {domain}::{op_type}: only the op namespaces {sorted(OP_DOMAINS)} "
                                "are allowed in a graph read from a file")
    if domain == "fxc":
        import fxcompiler.ops  # noqa: F401  (registers the fxc namespace)
    name, _, overload = op_type.partition(".")
    if not name.isidentifier() or (overload and not overload.isidentifier()):
        raise DisallowedOpError(f"dfg node calls {domain}::{op_type!r}, not an op name")
    try:
        packet = getattr(getattr(torch.ops, domain), name)
        return "call_function", getattr(packet, overload) if overload else packet
    except AttributeError:
        raise ValueError(f"dfg node calls {domain}::{op_type}, which is not a registered torch op") from None


# --------------------------------------------------------------------------- types


def _dim_text(d) -> int | str:
    if isinstance(d, torch.SymInt):
        expr = d.node.expr
        if getattr(expr, "is_Integer", False):
            return int(expr)
        return str(expr)
    return int(d)


def _type_proto(val: Any) -> onnx.TypeProto:
    t = onnx.TypeProto()
    if isinstance(val, torch.Tensor):
        t.tensor_type.elem_type = _DTYPES.get(val.dtype, onnx.TensorProto.UNDEFINED)
        t.tensor_type.shape.SetInParent()
        for d in val.shape:
            dim = t.tensor_type.shape.dim.add()
            text = _dim_text(d)
            if isinstance(text, int):
                dim.dim_value = text
            else:
                dim.dim_param = text
    else:
        t.opaque_type.domain = BUILTIN_DOMAIN
        if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
            t.opaque_type.name = "SymInt"
        elif isinstance(val, (torch.SymFloat, float)):
            t.opaque_type.name = "SymFloat"
        elif isinstance(val, (torch.SymBool, bool)):
            t.opaque_type.name = "SymBool"
        elif isinstance(val, (tuple, list)):
            t.opaque_type.name = "tuple"
        else:
            t.opaque_type.name = "unknown"
    return t


def _value_info(name: str, val: Any) -> onnx.ValueInfoProto:
    vi = onnx.ValueInfoProto(name=name)
    vi.type.CopyFrom(_type_proto(val))
    return vi


def _tensor_proto(name: str, tensor: torch.Tensor) -> onnx.TensorProto:
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"constant {name!r} has dtype {tensor.dtype}, which has no ONNX element type")
    tp = onnx.TensorProto(name=name, data_type=_DTYPES[tensor.dtype], dims=list(tensor.shape))
    data = tensor.detach().to("cpu").contiguous()
    tp.raw_data = data.view(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
    return tp


def _tensor_from_proto(tp: onnx.TensorProto, device=None) -> torch.Tensor:
    dtype = _TORCH_DTYPES.get(tp.data_type)
    if dtype is None:
        raise ValueError(f"initializer {tp.name!r} has ONNX element type {tp.data_type}, which torch lacks")
    shape = list(tp.dims)
    if tp.HasField("raw_data") or not any(len(getattr(tp, f)) for f in ("float_data", "int32_data", "int64_data",
                                                                       "double_data", "uint64_data")):
        raw = tp.raw_data
        t = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if raw
             else torch.empty(shape, dtype=dtype))
    else:
        from onnx import numpy_helper

        t = torch.from_numpy(numpy_helper.to_array(tp).copy()).to(dtype)
    return t if device is None else t.to(device)


# --------------------------------------------------------------------------- fx -> onnx


def _opset_imports(domains) -> list[onnx.OperatorSetIdProto]:
    out = [onnx.helper.make_opsetid("", onnx.defs.onnx_opset_version())]
    out += [onnx.helper.make_opsetid(d, 1) for d in sorted(domains)]
    return out


def fx_to_onnx(gm: torch.fx.GraphModule, name: str) -> onnx.ModelProto:
    """``gm`` as an ``onnx.checker``-valid ``ModelProto`` named ``name`` (see the module docstring)."""
    if type(gm.graph._codegen) is not torch.fx.graph.CodeGen:
        raise ValueError(f"graph {name!r} uses {type(gm.graph._codegen).__name__}; only flat fx graphs "
                         "(default CodeGen) convert to dfg")
    graph = onnx.GraphProto(name=name)
    domains: set[str] = set()
    order, placeholders, constants = [], {}, {}
    hints: dict[str, int] = {}
    output_struct = None
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            if node.args:
                raise ValueError(f"placeholder {node.name!r} has a default value; dfg graphs take none")
            graph.input.append(_value_info(node.name, val))
            placeholders[node.name] = node.target
            if isinstance(val, torch.Tensor):
                for d in val.shape:
                    if isinstance(d, torch.SymInt) and getattr(d.node.expr, "is_Symbol", False):
                        hints[str(d.node.expr)] = int(d.node.hint) if d.node.hint is not None else 2
        elif node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"get_attr node {node.name!r} reads a {type(value).__name__}; only tensor "
                                "constants convert to dfg initializers")
            graph.initializer.append(_tensor_proto(node.name, value))
            spec: dict[str, Any] = {"target": node.target}
            if value.numel() and not value.is_contiguous():
                spec["stride"] = list(value.stride())
            if isinstance(value, torch.nn.Parameter):
                spec["parameter"] = True
            constants[node.name] = spec
        elif node.op in ("call_function", "call_method"):
            domain, op_type = _op_identity(node)
            domains.add(domain)
            refs: dict[str, None] = {}
            args = json.dumps(_encode(list(node.args), refs), allow_nan=False)
            attrs = {"args": args}
            if node.kwargs:
                attrs["kwargs"] = json.dumps(_encode(dict(node.kwargs), refs)["$dict"], allow_nan=False)
            graph.node.append(onnx.helper.make_node(op_type, list(refs), [node.name], name=node.name,
                                                    domain=domain, **attrs))
            if val is not None:
                graph.value_info.append(_value_info(node.name, val))
        elif node.op == "output":
            refs = {}
            output_struct = _encode(node.args[0], refs)
            by_name = {n.name: n for n in gm.graph.nodes}
            for ref in refs:
                graph.output.append(_value_info(ref, by_name[ref].meta.get("val")))
            continue
        else:
            raise ValueError(f"fx node {node.name!r} has op {node.op!r}; dfg converts placeholder, get_attr, "
                             "call_function and call_method nodes")
        order.append(node.name)
    model = onnx.helper.make_model(graph, opset_imports=_opset_imports(domains), producer_name="fxcompiler",
                                   doc_string=f"fxcompiler dfg supertask {name}")
    meta = {"format": FORMAT, "order": order, "placeholders": placeholders, "constants": constants,
            "output": output_struct, "hints": hints}
    for key, value in meta.items():
        entry = model.metadata_props.add()
        entry.key = _META_PREFIX + key
        entry.value = value if isinstance(value, str) else json.dumps(value, allow_nan=False)
    return model


def _metadata(model: onnx.ModelProto) -> dict[str, Any]:
    out = {}
    for entry in model.metadata_props:
        if entry.key.startswith(_META_PREFIX):
            key = entry.key[len(_META_PREFIX):]
            out[key] = entry.value if key == "format" else json.loads(entry.value)
    return out


# --------------------------------------------------------------------------- onnx -> fx


def onnx_to_fx(model: onnx.ModelProto, device: torch.device | str | None = None, *,
               restore_meta: bool = False, class_name: str = "FxcDfgGraph") -> torch.fx.GraphModule:
    """The fx GraphModule a dfg model describes (inverse of :func:`fx_to_onnx`).

    ``device``: where the constants (initializers) go (default: CPU). ``restore_meta``: give
    every node its ``meta['val']`` back by fake propagation from the inputs' shapes (needed by
    passes, not by execution). A model without fxcompiler metadata converts too when its
    nodes use the domains above (inputs, then initializers, then nodes; outputs as a tuple)."""
    meta = _metadata(model)
    fmt = meta.get("format")
    if fmt is not None and fmt != FORMAT:
        raise ValueError(f"dfg model format {fmt!r} is not readable by this fxcompiler ({FORMAT})")
    g = model.graph
    inputs = {vi.name: vi for vi in g.input}
    inits = {tp.name: tp for tp in g.initializer}
    nodes = {n.name or n.output[0]: n for n in g.node}
    placeholders = meta.get("placeholders", {})
    const_specs = meta.get("constants", {})
    init_names = set(inits)
    order = meta.get("order") or ([n for n in inputs if n not in init_names] + list(inits) + list(nodes))
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for name in order:
        if name in nodes:
            onode = nodes[name]
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in onode.attribute}
            op, target = _resolve_target(onode.domain, onode.op_type)
            args = tuple(_decode(json.loads(attrs["args"]), env)) if "args" in attrs else \
                tuple(env[i] for i in onode.input)
            kwargs = ({_decode(k, env): _decode(v, env) for k, v in json.loads(attrs["kwargs"])}
                      if "kwargs" in attrs else {})
            fx_node = graph.create_node(op, target, args, kwargs, name=name)
            out_name = onode.output[0] if onode.output else name
        elif name in inits:
            spec = const_specs.get(name, {})
            path = spec.get("target", name)
            tensor = _tensor_from_proto(inits[name])
            if "stride" in spec:
                tensor = torch.empty_strided(tensor.shape, spec["stride"], dtype=tensor.dtype).copy_(tensor)
            if device is not None:
                tensor = tensor.to(device)
            _set_attr(root, path, torch.nn.Parameter(tensor, requires_grad=False) if spec.get("parameter")
                      else tensor)
            fx_node = graph.create_node("get_attr", path, name=name)
            out_name = name
        elif name in inputs:
            fx_node = graph.create_node("placeholder", placeholders.get(name, name), name=name)
            out_name = name
        else:
            raise ValueError(f"dfg model names {name!r} in its node order but has no such input, "
                             "initializer or node")
        if fx_node.name != name:
            raise ValueError(f"dfg value name {name!r} is not a usable fx node name (got {fx_node.name!r})")
        env[out_name] = fx_node
    if "output" in meta:
        out = _decode(meta["output"], env)
    else:
        outs = tuple(env[vi.name] for vi in g.output)
        out = outs
    graph.output(out)
    gm = torch.fx.GraphModule(root, graph, class_name=class_name)
    if restore_meta:
        from .graph_io import restore_meta as _restore

        signature = placeholder_signature(model)
        if signature is None:
            raise ValueError("dfg model inputs lack the shapes needed to restore meta['val']")
        _restore(gm, signature)
    return gm


def _set_attr(root: torch.nn.Module, path: str, tensor: torch.Tensor) -> None:
    owner = root
    *parents, leaf = path.split(".")
    for part in parents:
        if not hasattr(owner, part):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    if isinstance(tensor, torch.nn.Parameter):
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor)


def placeholder_signature(model: onnx.ModelProto) -> dict[str, Any] | None:
    """The :func:`fxcompiler.graph_io.placeholder_signature` of the graph ``model`` describes
    (for :func:`fxcompiler.graph_io.restore_meta`), or None when an input is not a tensor with
    plain int/symbol dims."""
    meta = _metadata(model)
    hints = dict(meta.get("hints", {}))
    phs = {}
    for vi in model.graph.input:
        tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
        if tt is None or tt.elem_type not in _TORCH_DTYPES or not tt.HasField("shape"):
            return None
        shape = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                shape.append(int(d.dim_value))
            elif d.HasField("dim_param") and d.dim_param.isidentifier():
                shape.append(d.dim_param)
                hints.setdefault(d.dim_param, 2)
            else:
                return None
        phs[vi.name] = {"shape": shape, "dtype": str(_TORCH_DTYPES[tt.elem_type]).removeprefix("torch.")}
    return {"placeholders": phs, "hints": hints}


# --------------------------------------------------------------------------- blobs and pipelines


def serialize(model: onnx.ModelProto) -> bytes:
    """Bytes of a dfg blob (for artifacts); :func:`deserialize` reads them back."""
    return model.SerializeToString()


def deserialize(data: bytes) -> onnx.ModelProto:
    return onnx.load_from_string(data)


def blob_id(model: onnx.ModelProto, data: bytes | None = None) -> str:
    """Content id of a dfg blob: ``DataBlob.content_id("dfg", sha256 of the serialized model)``."""
    data = serialize(model) if data is None else data
    return DataBlob.content_id("dfg", hashlib.sha256(data).hexdigest())


def to_dfg_blob(blob: DataBlob) -> DataBlob:
    """A dfg DataBlob from an fx one (the fx blob's id names the graph)."""
    if blob.kind != "fx" or not isinstance(blob.graph, torch.fx.GraphModule):
        raise ValueError(f"blob {blob.id} is a {blob.kind!r} blob holding {type(blob.graph).__name__}; "
                         "to_dfg converts fx blobs with their GraphModule")
    model = fx_to_onnx(blob.graph, f"fx_{blob.id}")
    return DataBlob(blob_id(model), "dfg", model)


def to_dfg_pipeline(pipeline: Pipeline, cache: dict[str, DataBlob] | None = None) -> Pipeline:
    """``pipeline`` with every fx compute supertask turned into a dfg one.

    Each fx blob is converted once (``cache``: fx blob id → dfg DataBlob; pass the same dict
    for all of a model's pipelines, which share their blobs); blobs get content ids of the
    serialized ModelProto and the supertasks' ``data_blob`` follows. Non-fx supertasks and
    everything else (tensors, params, metadata) are kept (copied)."""
    cache = {} if cache is None else cache

    def convert(blob: DataBlob) -> DataBlob:
        if blob.id not in cache:
            cache[blob.id] = to_dfg_blob(blob)
        return cache[blob.id]

    return retarget_compute_supertasks(pipeline, SuperTaskKind.FX, SuperTaskKind.DFG, convert)


def to_dfg_pipelines(pipelines: list[Pipeline]) -> list[Pipeline]:
    """:func:`to_dfg_pipeline` over a model's pipelines, converting each shared blob once."""
    cache: dict[str, DataBlob] = {}
    return [to_dfg_pipeline(p, cache) for p in pipelines]


# --------------------------------------------------------------------------- analysis


def dfg_graph(model: onnx.ModelProto):
    """``networkx.DiGraph``: one node per ONNX node (``op_type``, ``domain``, ``index``), an edge
    producer → consumer per pair, ``tensors`` = the value names it carries. ``graph.graph``
    holds ``inputs``, ``initializers`` and ``outputs`` (value names)."""
    import networkx as nx

    G = nx.DiGraph(inputs=[vi.name for vi in model.graph.input],
                   initializers=[tp.name for tp in model.graph.initializer],
                   outputs=[vi.name for vi in model.graph.output])
    producer: dict[str, str] = {}
    for i, node in enumerate(model.graph.node):
        key = node.name or f"{i}:{node.op_type}"
        if key in G:
            key = f"{key}#{i}"
        G.add_node(key, op_type=node.op_type, domain=node.domain, index=i)
        for name in node.input:
            src = producer.get(name)
            if src is None:
                continue
            if G.has_edge(src, key):
                if name not in G.edges[src, key]["tensors"]:
                    G.edges[src, key]["tensors"].append(name)
            else:
                G.add_edge(src, key, tensors=[name])
        for name in node.output:
            producer[name] = key
    return G


def _elem_size(elem_type: int) -> int | None:
    dtype = _TORCH_DTYPES.get(elem_type)
    return None if dtype is None else torch.empty((), dtype=dtype).element_size()


_MAX_DIM_TEXT = 256


def _dim_value(text: str, sizes: dict[str, int]) -> int | None:
    """A ``dim_param`` (a symbol or an expression of symbols, e.g. ``s37*s29``) under ``sizes``;
    None when it is not a small integer expression of known symbols. Parsed with :mod:`ast`
    and evaluated over an allow-list of integer operations: never ``eval``/``sympify``."""
    if text in sizes:
        return int(sizes[text])
    if not isinstance(text, str) or len(text) > _MAX_DIM_TEXT:
        return None
    import ast

    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return None
    return _int_expr(tree.body, sizes)


def _int_expr(node, sizes: dict[str, int]) -> int | None:
    import ast

    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name):
        v = sizes.get(node.id)
        return int(v) if v is not None else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _int_expr(node.operand, sizes)
        return None if v is None else -v
    if isinstance(node, ast.BinOp):
        a, b = _int_expr(node.left, sizes), _int_expr(node.right, sizes)
        if a is None or b is None:
            return None
        op = type(node.op)
        if op is ast.Add:
            return a + b
        if op is ast.Sub:
            return a - b
        if op is ast.Mult:
            return a * b if abs(a * b) < 1 << 62 else None
        if op in (ast.FloorDiv, ast.Mod) and b != 0:
            return a // b if op is ast.FloorDiv else a % b
        return None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        args = [_int_expr(a, sizes) for a in node.args]
        if any(a is None for a in args) or not args:
            return None
        fn = {"Max": max, "Min": min}.get(node.func.id)
        if fn is not None:
            return fn(args)
        if node.func.id in ("FloorDiv", "floor_div") and len(args) == 2 and args[1]:
            return args[0] // args[1]
        if node.func.id in ("Mod", "PythonMod") and len(args) == 2 and args[1]:
            return args[0] % args[1]
        if node.func.id == "CeilDiv" and len(args) == 2 and args[1]:
            return -(-args[0] // args[1])
    return None


def _bytes_of(vi: onnx.ValueInfoProto, sizes: dict[str, int]) -> int | None:
    tt = vi.type.tensor_type
    size = _elem_size(tt.elem_type)
    if size is None or not tt.HasField("shape"):
        return None
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            size *= d.dim_value
            continue
        value = _dim_value(d.dim_param, sizes)
        if value is None:
            return None
        size *= value
    return size


def input_sizes(model: onnx.ModelProto, inputs: dict[str, Any]) -> dict[str, int]:
    """Bindings of the inputs' symbolic dims (``dim_param`` symbols) read off concrete
    ``inputs`` (graph input name → tensor), for :func:`liveness`."""
    sizes: dict[str, int] = {}
    for vi in model.graph.input:
        value = inputs.get(vi.name)
        if value is None or not vi.type.HasField("tensor_type"):
            continue
        for d, n in zip(vi.type.tensor_type.shape.dim, value.shape):
            if d.HasField("dim_param") and d.dim_param.isidentifier():
                sizes.setdefault(d.dim_param, int(n))
    return sizes


_NO_STORAGE = ("SymInt", "SymFloat", "SymBool", "tuple")


def liveness(model: onnx.ModelProto, sizes: dict[str, int] | None = None) -> dict[str, Any]:
    """Peak of simultaneously live intermediate tensors in node order.

    An intermediate (a node output that is a tensor, or has no type) is live from its producer
    to its last reader (graph outputs: to the end). Views are counted as tensors of their own.
    ``sizes`` binds the symbols of symbolic dims (``dim_param``, expressions allowed) to ints
    for byte counts (:func:`input_sizes` reads them off concrete inputs). Returns
    ``{"num_intermediates", "max_live", "peak_node", "max_live_bytes", "peak_bytes_node"}``;
    ``max_live_bytes`` is None when some intermediate's size is not known."""
    sizes = sizes or {}
    types = {vi.name: vi for vi in list(model.graph.value_info) + list(model.graph.output)}
    nodes = list(model.graph.node)
    end = len(nodes)
    born, last = {}, {}
    for i, node in enumerate(nodes):
        for name in node.input:
            if name in born:
                last[name] = i
        for name in node.output:
            vi = types.get(name)
            if vi is not None and vi.type.opaque_type.name in _NO_STORAGE:
                continue  # SymInts, tuples: no storage of their own
            born[name] = i
            last.setdefault(name, i)
    for vi in model.graph.output:
        if vi.name in born:
            last[vi.name] = end
    nbytes = {name: (_bytes_of(types[name], sizes) if name in types else None) for name in born}
    known = all(b is not None for b in nbytes.values())
    delta_n = [0] * (end + 2)
    delta_b = [0] * (end + 2)
    for name, i in born.items():
        delta_n[i] += 1
        delta_n[last[name] + 1] -= 1
        delta_b[i] += nbytes[name] or 0
        delta_b[last[name] + 1] -= nbytes[name] or 0
    live = live_b = 0
    best = (0, None)
    best_b = (0, None)
    for i in range(end):
        live += delta_n[i]
        live_b += delta_b[i]
        name = nodes[i].name or f"{i}:{nodes[i].op_type}"
        if live > best[0]:
            best = (live, name)
        if live_b > best_b[0]:
            best_b = (live_b, name)
    return {"num_intermediates": len(born), "max_live": best[0], "peak_node": best[1],
            "max_live_bytes": best_b[0] if known else None, "peak_bytes_node": best_b[1] if known else None}


def critical_path(model: onnx.ModelProto) -> list[str]:
    """The longest dependency chain of ONNX nodes (by node count), as node names."""
    import networkx as nx

    return list(nx.dag_longest_path(dfg_graph(model)))
