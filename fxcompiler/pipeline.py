"""Pipeline IR: buckets, devices, tensors, parameters, supertasks and graph blobs.

A :class:`Pipeline` is the DAG one bucket runs: ``input`` → compute supertasks
(``fx``/``dfg``/``edf``) and communication supertasks → ``output``, over named tensors.
It is pure data; graph blobs are referenced by content hash so identical graphs are
stored and compiled once (furiosa_llm_semantics.md §1.4, §2.5).
"""
from __future__ import annotations

import enum
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

PIPELINE_SCHEMA_VERSION = "0.1.0"

_DTYPE_NAMES = {
    "torch.float64": "f64", "torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16",
    "torch.float8_e4m3fn": "f8", "torch.bool": "bool", "torch.int64": "i64", "torch.int32": "i32",
    "torch.int16": "i16", "torch.int8": "i8", "torch.uint8": "u8",
}


def dtype_name(dtype) -> str:
    """furiosa pipeline dtype spelling (``f32``, ``bf16``, ``i64``...) of a torch dtype."""
    return _DTYPE_NAMES.get(str(dtype), str(dtype).removeprefix("torch."))


@dataclass(frozen=True, order=True)
class Bucket:
    """A compiled shape class: ``kv_cache_size == 0`` is prefill, otherwise decode."""

    batch_size: int
    attention_size: int
    kv_cache_size: int = 0

    def __post_init__(self):
        for name in ("batch_size", "attention_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Bucket.{name} must be a positive int, got {v!r}")
        if not 0 <= self.kv_cache_size < self.attention_size:
            raise ValueError(f"Bucket.kv_cache_size must be in [0, attention_size), got {self.kv_cache_size}")

    @classmethod
    def prefill(cls, batch_size: int, attention_size: int) -> "Bucket":
        return cls(batch_size, attention_size, 0)

    @classmethod
    def decode(cls, batch_size: int, attention_size: int) -> "Bucket":
        return cls(batch_size, attention_size, attention_size - 1)

    @property
    def input_ids_size(self) -> int:
        return self.attention_size - self.kv_cache_size

    @property
    def is_prefill(self) -> bool:
        return self.kv_cache_size == 0

    @property
    def is_decode(self) -> bool:
        return self.kv_cache_size > 0

    @property
    def phase(self) -> str:
        return "prefill" if self.is_prefill else "decode"


def pipeline_name(model: str, bucket: Bucket) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", model)
    return f"{safe}-kv{bucket.kv_cache_size}-b{bucket.batch_size}-attn{bucket.attention_size}"


_DEVICE_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")
_NPU_RE = re.compile(r"^(npu):(\d+)(?::(\*|\d+|\d+-\d+))?$|^(rngd):(\d+):(\d+)$")
_BACKEND_DEVICE_KINDS = {"cpu", "cuda"}


class Device(str):
    """A device string: ``cpu``, ``cpu:N``, ``cuda``, ``cuda:N`` (and furiosa's ``npu:X[:...]``,
    which parses but is refused since no NPU backend is registered)."""

    def __new__(cls, value: str):
        if not isinstance(value, str):
            raise TypeError(f"device must be a string like 'cpu' or 'cuda:0', got {type(value).__name__}")
        text = value.strip()
        m = _DEVICE_RE.match(text)
        if m is None:
            if _NPU_RE.match(text):
                raise ValueError(f"device {text!r} is a Furiosa NPU device; fxcompiler has no NPU backend "
                                 "(registered device kinds: cpu, cuda)")
            raise ValueError(f"invalid device {value!r}: expected 'cpu', 'cpu:N', 'cuda' or 'cuda:N'")
        return super().__new__(cls, text)

    @property
    def kind(self) -> str:
        return self.split(":")[0]

    @property
    def idx(self) -> int:
        parts = self.split(":")
        return int(parts[1]) if len(parts) > 1 else 0

    def to_torch_device(self):
        import torch

        return torch.device("cpu") if self.kind == "cpu" else torch.device(str(self))


def parse_devices(devices) -> list[Device]:
    """``"cpu"``, ``"cuda:0,cuda:1"`` or a sequence of strings/Devices -> list of :class:`Device`."""
    if devices is None:
        return [Device("cpu")]
    if isinstance(devices, str):
        items = [d for d in devices.split(",") if d.strip()]
    elif isinstance(devices, (list, tuple)):
        items = list(devices)
    else:
        raise TypeError(f"devices must be a string or a sequence of device strings, got {type(devices).__name__}")
    if not items:
        raise ValueError("devices must name at least one device")
    return [d if isinstance(d, Device) else Device(d) for d in items]


@dataclass
class TensorInfo:
    shape: list[int | str]
    dtype: str


@dataclass
class ParamValue:
    param_file: str
    name: str  # key in the param file
    name_in_graph: str  # placeholder name
    placements: list[tuple[int, int]] | None = None


@dataclass
class ParamInfo:
    shape: list[int]
    dtype: str
    value: ParamValue


@dataclass
class ParamFileInfo:
    path: str  # "" for parameters held in memory only
    format: str  # "safetensors" | "pt" | "memory"


class SuperTaskKind(str, enum.Enum):
    INPUT = "input"
    OUTPUT = "output"
    FX = "fx"
    DFG = "dfg"
    EDF = "edf"
    SEND = "send"
    RECV = "recv"
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"

    @property
    def is_compute(self) -> bool:
        return self in (SuperTaskKind.FX, SuperTaskKind.DFG, SuperTaskKind.EDF)


@dataclass
class SuperTask:
    kind: SuperTaskKind
    inputs: list[str]
    outputs: list[str]
    device: str | None = None
    data_blob: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataBlob:
    """A graph blob: kind + content hash; ``graph`` is the in-memory object (GraphModule)."""

    id: str
    kind: str
    graph: Any = None

    @staticmethod
    def content_id(kind: str, text: str) -> str:
        return hashlib.sha256(f"{kind}\n{text}".encode()).hexdigest()[:20]


@dataclass
class Pipeline:
    name: str
    bucket: Bucket
    devices: dict[str, str]
    tensors: dict[str, TensorInfo | ParamInfo]
    supertasks: dict[str, SuperTask]
    blobs: dict[str, DataBlob]
    param_files: dict[str, ParamFileInfo]
    metadata: dict[str, Any] = field(default_factory=dict)
    version: str = PIPELINE_SCHEMA_VERSION

    def compute_supertasks(self) -> list[tuple[str, SuperTask]]:
        return [(k, t) for k, t in self.supertasks.items() if t.kind.is_compute]

    def to_dict(self) -> dict:
        def enc(obj):
            if isinstance(obj, enum.Enum):
                return obj.value
            if isinstance(obj, dict):
                return {k: enc(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return [enc(v) for v in obj]
            return obj

        return {
            "name": self.name, "version": self.version, "bucket": asdict(self.bucket),
            "devices": dict(self.devices),
            "tensors": {k: {"kind": "param" if isinstance(v, ParamInfo) else "tensor", **enc(asdict(v))}
                        for k, v in self.tensors.items()},
            "supertasks": {k: {**enc(asdict(t)), "kind": t.kind.value} for k, t in self.supertasks.items()},
            "blobs": {k: {"id": b.id, "kind": b.kind} for k, b in self.blobs.items()},
            "param_files": {k: asdict(v) for k, v in self.param_files.items()},
            "metadata": enc(self.metadata),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)


def _tensor_from_dict(t: dict) -> TensorInfo | ParamInfo:
    if t["kind"] == "param":
        v = t["value"]
        placements = [tuple(p) for p in v["placements"]] if v.get("placements") is not None else None
        return ParamInfo(list(t["shape"]), t["dtype"], ParamValue(v["param_file"], v["name"], v["name_in_graph"],
                                                                  placements))
    return TensorInfo(list(t["shape"]), t["dtype"])


def _supertasks_from_dict(data: dict) -> dict[str, SuperTask]:
    return {k: SuperTask(SuperTaskKind(t["kind"]), list(t["inputs"]), list(t["outputs"]), t.get("device"),
                         t.get("data_blob"), dict(t.get("metadata") or {}))
            for k, t in data.items()}


def _blobs_from_dict(data: dict, blobs: dict[str, Any] | None) -> dict[str, DataBlob]:
    loaded = blobs or {}
    out = {}
    for k, b in data.items():
        if b["id"] not in loaded and blobs is not None:
            raise ValueError(f"graph blob {b['id']} is missing")
        out[k] = DataBlob(b["id"], b["kind"], loaded.get(b["id"]))
    return out


def _param_files_from_dict(data: dict) -> dict[str, ParamFileInfo]:
    return {k: ParamFileInfo(v["path"], v["format"]) for k, v in data.items()}


def _check_version(version) -> None:
    if str(version).split(".")[0] != PIPELINE_SCHEMA_VERSION.split(".")[0]:
        raise ValueError(f"pipeline schema {version} is not readable by this fxcompiler "
                         f"(schema {PIPELINE_SCHEMA_VERSION})")


def pipeline_from_dict(data: dict, blobs: dict[str, Any] | None = None) -> Pipeline:
    """Inverse of :meth:`Pipeline.to_dict`; ``blobs`` maps blob ids to loaded graphs.

    Raises ``ValueError`` naming what is missing or malformed."""
    try:
        version = data["version"]
        _check_version(version)
        return Pipeline(
            name=data["name"], bucket=Bucket(**data["bucket"]), devices=dict(data["devices"]),
            tensors={name: _tensor_from_dict(t) for name, t in data["tensors"].items()},
            supertasks=_supertasks_from_dict(data["supertasks"]), blobs=_blobs_from_dict(data["blobs"], blobs),
            param_files=_param_files_from_dict(data["param_files"]),
            metadata=dict(data.get("metadata") or {}), version=version)
    except KeyError as exc:
        raise ValueError(f"pipeline description lacks the field {exc.args[0]!r}") from None


# Fields whose value the pipelines of one build usually share (every bucket runs the same blobs with the
# same supertasks, devices and parameter files): the compact form stores each distinct value once.
_SHARED_FIELDS = ("devices", "supertasks", "blobs", "param_files", "metadata", "tensor_order")


def pipelines_to_compact(pipelines: Sequence[Pipeline]) -> dict:
    """The ``to_dict`` records of ``pipelines`` with what they share stored once: tensor records equal in
    every pipeline under ``common_tensors``, each distinct value of the shared fields once in ``tables``
    (a pipeline names it by index), and per pipeline only its own tensor records (the bucket-shaped
    inputs and activations). SmolLM2's 277 bucket pipelines: 27 MB of plain records, 1 MB compact.
    :func:`pipelines_from_compact` is the inverse."""
    dicts = [p.to_dict() for p in pipelines]
    for d in dicts:
        d["tensor_order"] = list(d["tensors"])
    common: dict[str, Any] = {}
    if dicts:
        common = {n: t for n, t in dicts[0]["tensors"].items() if all(d["tensors"].get(n) == t for d in dicts[1:])}
    tables: dict[str, list] = {f: [] for f in _SHARED_FIELDS}
    seen: dict[str, dict[str, int]] = {f: {} for f in _SHARED_FIELDS}
    records = []
    for d in dicts:
        rec = {k: v for k, v in d.items() if k not in _SHARED_FIELDS and k != "tensors"}
        rec["tensors"] = {n: t for n, t in d["tensors"].items() if n not in common}
        for f in _SHARED_FIELDS:
            key = json.dumps(d[f], sort_keys=True)
            if key not in seen[f]:
                seen[f][key] = len(tables[f])
                tables[f].append(d[f])
            rec[f] = seen[f][key]
        records.append(rec)
    return {"common_tensors": common, "tables": tables, "pipelines": records}


def pipelines_from_compact(data: dict, blobs: dict[str, Any] | None = None) -> list[Pipeline]:
    """Inverse of :func:`pipelines_to_compact` (``blobs`` as for :func:`pipeline_from_dict`). The records
    the pipelines share are decoded once and their objects shared between them (each pipeline has its
    own dicts); nothing mutates these records after a build. Raises ``ValueError`` naming what is missing
    or malformed."""
    try:
        common = {n: _tensor_from_dict(t) for n, t in data["common_tensors"].items()}
        tables = data["tables"]
        decoders = {"devices": dict, "supertasks": _supertasks_from_dict, "param_files": _param_files_from_dict,
                    "blobs": lambda b: _blobs_from_dict(b, blobs), "metadata": dict, "tensor_order": list}
        decoded: dict[tuple[str, int], Any] = {}

        def shared(rec: dict, f: str):
            i = rec[f]
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(tables[f]):
                raise ValueError(f"pipeline {rec.get('name')!r}: {f} index {i!r} is not in the table "
                                 f"of {len(tables[f])}")
            if (f, i) not in decoded:
                decoded[f, i] = decoders[f](tables[f][i])
            return decoded[f, i]

        out = []
        for rec in data["pipelines"]:
            _check_version(rec["version"])
            own = {n: _tensor_from_dict(t) for n, t in rec["tensors"].items()}
            order = shared(rec, "tensor_order")
            unknown = set(own) - set(order)
            if unknown:
                raise ValueError(f"pipeline {rec['name']!r}: tensors {sorted(unknown)} are not in its tensor order")
            missing = [n for n in order if n not in own and n not in common]
            if missing:
                raise ValueError(f"pipeline {rec['name']!r}: tensors {missing[:5]} have no record")
            out.append(Pipeline(
                name=rec["name"], bucket=Bucket(**rec["bucket"]), devices=dict(shared(rec, "devices")),
                tensors={n: own[n] if n in own else common[n] for n in order},
                supertasks=dict(shared(rec, "supertasks")), blobs=dict(shared(rec, "blobs")),
                param_files=dict(shared(rec, "param_files")), metadata=dict(shared(rec, "metadata")),
                version=rec["version"]))
        return out
    except KeyError as exc:
        raise ValueError(f"compact pipeline records lack the field {exc.args[0]!r}") from None


def retarget_compute_supertasks(pipeline: Pipeline, from_kind: SuperTaskKind, to_kind: SuperTaskKind,
                                convert: Any) -> Pipeline:
    """A copy of ``pipeline`` whose ``from_kind`` supertasks become ``to_kind`` supertasks over
    ``convert(blob) -> DataBlob`` (called once per blob id here; callers memoise across
    pipelines). Tensors, devices, params and metadata are copied; other supertasks are kept.
    This is how a built fx pipeline becomes a dfg/edf one, and how their executors hand a
    pipeline back to the fx executor."""
    import dataclasses

    supertasks, blobs, done = {}, {}, {}
    for key, task in pipeline.supertasks.items():
        copy = dict(inputs=list(task.inputs), outputs=list(task.outputs), metadata=dict(task.metadata))
        if task.kind is from_kind:
            if task.data_blob not in done:
                done[task.data_blob] = convert(pipeline.blobs[task.data_blob])
            new = done[task.data_blob]
            blobs[new.id] = new
            supertasks[key] = dataclasses.replace(task, kind=to_kind, data_blob=new.id, **copy)
        else:
            supertasks[key] = dataclasses.replace(task, **copy)
            if task.data_blob is not None and task.data_blob in pipeline.blobs:
                blobs[task.data_blob] = pipeline.blobs[task.data_blob]
    return dataclasses.replace(pipeline, supertasks=supertasks, blobs=blobs, tensors=dict(pipeline.tensors),
                               devices=dict(pipeline.devices), param_files=dict(pipeline.param_files),
                               metadata=dict(pipeline.metadata))
