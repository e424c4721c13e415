"""Artifacts: a built model as a directory that loads without the model's source or code paths.

Layout (DESIGN §8, documented in docs/artifact-format.md)::

    artifact.json   manifest: schema, versions, host, model, buckets, passes, kind, files + sha256
    model/          config.json, generation_config.json, tokenizer files (chat template included)
    params/         params.safetensors (or params.pt): the pipelines' parameters, prepacked
    pipelines/      one JSON per bucket (the supertask DAG)
    graphs/         <blob-id>.py (+ <blob-id>.constants.safetensors) for fx, <blob-id>.onnx for dfg:
                    deduplicated graph blobs

Writing goes to a temporary sibling directory that is renamed into place, so an
interrupted export never leaves a half-written artifact. Reading checks the schema,
then that every listed file exists with its size and sha256 (naming the file when not),
*before* any graph code is run or any file parsed; every path the manifest names must be
one of those files, inside the artifact (docs/security.md).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .compile_cache import load_tensors, save_tensors
from .integrity import IntegrityError, confined, load_allowlist, verify_records
from .graph_io import graph_constants, graph_module_source, load_graph_module, placeholder_signature
from .pipeline import Bucket, Pipeline, pipeline_from_dict

log = logging.getLogger("fxcompiler.artifacts")

ARTIFACT_SCHEMA_VERSION = "1.0"
MANIFEST = "artifact.json"
PARAM_FILE_ID = "0"
REQUIRED_KEYS = ("files", "model", "buckets", "geometry", "settings", "params", "graphs", "pipelines")


class ArtifactError(ValueError):
    """An artifact directory that cannot be loaded (the message names the file and the reason)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def bucket_file_name(bucket: Bucket) -> str:
    return f"{bucket.phase}-b{bucket.batch_size}-a{bucket.attention_size}-kv{bucket.kv_cache_size}.json"


def host_description() -> dict[str, Any]:
    try:
        from backends.cpu import _build

        isa = _build.detect_isa()
    except Exception:  # noqa: BLE001 - no backend package: describe the machine only
        isa = "unknown"
    return {"machine": platform.machine(), "isa": isa, "cuda": torch.cuda.is_available()}


@dataclass
class ArtifactContents:
    """What :func:`export_artifact` needs from a built LLM (and :func:`read_artifact` returns)."""

    model_id: str
    config: Any
    generation_config: Any
    tokenizer: Any
    pipelines: list[Pipeline]
    params: dict[str, torch.Tensor]
    geometry: Any
    settings: dict[str, Any]  # engine settings: block size, max_seq_len_to_capture, prompt_max_seq_len, ...
    passes: list[dict] = field(default_factory=list)
    manifest: dict[str, Any] = field(default_factory=dict)
    model_dir: Path | None = None
    source_graphs: dict[str, Any] = field(default_factory=dict)  # edf blob id -> its fx graph (to recompile)


def export_artifact(contents: ArtifactContents, path: str | os.PathLike, *, param_saved_format: str = "safetensors",
                    extra: Callable[[Path], dict] | None = None) -> Path:
    """Write ``contents`` as an artifact directory at ``path`` (which must not exist or be empty).
    ``extra(tmp)`` may write more files into the directory (the files list covers them) and
    returns entries to add to the manifest (e.g. the draft model under ``speculative_model/``)."""
    import transformers

    import fxcompiler

    target = Path(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"artifacts_export_path={os.fspath(path)!r} exists and is not an empty directory")
    if param_saved_format not in ("safetensors", "pt"):
        raise ValueError(f"param_saved_format must be 'safetensors' or 'pt', got {param_saved_format!r}")
    t0 = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        (tmp / "model").mkdir(parents=True)
        contents.config.save_pretrained(tmp / "model")
        if contents.generation_config is not None:
            contents.generation_config.save_pretrained(tmp / "model")
        if contents.tokenizer is not None and hasattr(contents.tokenizer, "save_pretrained"):
            contents.tokenizer.save_pretrained(tmp / "model")
        (tmp / "params").mkdir()
        param_rel = f"params/params.{'safetensors' if param_saved_format == 'safetensors' else 'pt'}"
        if param_saved_format == "safetensors":
            aliases = save_tensors(contents.params, tmp / param_rel)
        else:
            aliases = {}
            torch.save({k: v.detach().contiguous().clone() for k, v in contents.params.items()}, tmp / param_rel)
        (tmp / "graphs").mkdir()
        (tmp / "pipelines").mkdir()
        blobs: dict[str, dict] = {}
        for pipe in contents.pipelines:
            for blob in pipe.blobs.values():
                if blob.id in blobs:
                    continue
                if blob.kind == "edf":  # an AOTInductor package, plus the fx graph it was compiled from
                    from .edf import serialize as edf_bytes

                    (tmp / "graphs" / f"{blob.id}.pt2").write_bytes(edf_bytes(blob.graph))
                    entry = {"kind": "edf", "code": f"graphs/{blob.id}.pt2", "key": blob.graph.key,
                             "device_type": blob.graph.device_type}
                    source = contents.source_graphs.get(blob.id)
                    if source is not None:
                        entry["source"] = f"graphs/{blob.id}.py"
                        entry["signature"] = placeholder_signature(source)
                        (tmp / entry["source"]).write_text(graph_module_source(source))
                        consts = graph_constants(source)
                        if consts:
                            entry["constants"] = f"graphs/{blob.id}.constants.safetensors"
                            entry["constant_aliases"] = save_tensors(consts, tmp / entry["constants"])
                    blobs[blob.id] = entry
                    continue
                if blob.kind == "dfg":  # an ONNX ModelProto: constants are its initializers
                    from .dfg import serialize

                    (tmp / "graphs" / f"{blob.id}.onnx").write_bytes(serialize(blob.graph))
                    blobs[blob.id] = {"kind": "dfg", "code": f"graphs/{blob.id}.onnx"}
                    continue
                if blob.kind != "fx":
                    raise NotImplementedError(f"exporting {blob.kind!r} graph blobs is not implemented yet")
                (tmp / "graphs" / f"{blob.id}.py").write_text(graph_module_source(blob.graph))
                consts = graph_constants(blob.graph)
                entry = {"kind": blob.kind, "code": f"graphs/{blob.id}.py"}
                if consts:
                    entry["constants"] = f"graphs/{blob.id}.constants.safetensors"
                    entry["constant_aliases"] = save_tensors(consts, tmp / entry["constants"])
                blobs[blob.id] = entry
            data = pipe.to_dict()
            data["param_files"] = {k: {"path": param_rel, "format": param_saved_format} for k in data["param_files"]}
            (tmp / "pipelines" / bucket_file_name(pipe.bucket)).write_text(json.dumps(data, indent=1, sort_keys=True))
        g = contents.geometry
        manifest = {
            "schema_version": ARTIFACT_SCHEMA_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": {"fxcompiler": fxcompiler.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__},
            "host": host_description(),
            "model": {"id": contents.model_id, "architecture": (getattr(contents.config, "architectures", None)
                                                                 or [type(contents.config).__name__])[0],
                      "config_sha256": _sha256(tmp / "model" / "config.json")},
            "buckets": {"prefill": [[b.batch_size, b.attention_size] for b in _buckets(contents, True)],
                        "decode": [[b.batch_size, b.attention_size] for b in _buckets(contents, False)],
                        "all": [[b.batch_size, b.attention_size, b.kv_cache_size]
                                for b in (p.bucket for p in contents.pipelines)]},
            "parallel": {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1,
                         "devices": sorted({d for p in contents.pipelines for d in p.devices.values()})},
            "passes": contents.passes,
            "supertask_kind": sorted({b["kind"] for b in blobs.values()}),
            "geometry": {"num_layers": g.num_layers, "num_kv_heads": g.num_kv_heads, "head_dim": g.head_dim,
                         "vocab_size": g.vocab_size, "dtype": str(g.dtype).removeprefix("torch."),
                         "max_position_embeddings": g.max_position_embeddings},
            "settings": contents.settings,
            "params": {"file": param_rel, "format": param_saved_format, "aliases": aliases,
                       "bytes": sum(t.numel() * t.element_size() for t in contents.params.values())},
            "graphs": blobs,
            "pipelines": sorted(f"pipelines/{bucket_file_name(p.bucket)}" for p in contents.pipelines),
        }
        if extra is not None:
            manifest.update(extra(tmp))
        manifest["files"] = {
            str(f.relative_to(tmp)): {"size": f.stat().st_size, "sha256": _sha256(f)}
            for f in sorted(tmp.rglob("*")) if f.is_file()
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("artifact written to %s in %.1fs", target, time.perf_counter() - t0)
    return target


def _buckets(contents: ArtifactContents, prefill: bool) -> list[Bucket]:
    names = "prefill_buckets" if prefill else "decode_buckets"
    return [Bucket(*b) for b in contents.settings.get(names, [])]


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    root = Path(path)
    if not root.is_dir():
        raise ArtifactError(f"artifact {os.fspath(path)!r} is not a directory")
    mf = root / MANIFEST
    if not mf.is_file():
        raise ArtifactError(f"{mf}: missing manifest (is {os.fspath(path)!r} an fxcompiler artifact?)")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{mf}: not valid JSON ({exc})") from None
    version = str(manifest.get("schema_version", ""))
    ours = ARTIFACT_SCHEMA_VERSION.split(".")
    theirs = version.split(".")
    if not version or not all(p.isdigit() for p in theirs):
        raise ArtifactError(f"{mf}: malformed schema_version {version!r}")
    if int(theirs[0]) != int(ours[0]) or (len(theirs) > 1 and int(theirs[1]) > int(ours[1])):
        raise ArtifactError(f"{mf}: artifact schema {version} is newer than (or incompatible with) the schema "
                            f"{ARTIFACT_SCHEMA_VERSION} this fxcompiler reads; rebuild it or upgrade fxcompiler")
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise ArtifactError(f"{mf}: manifest lacks {missing} (written by another tool, or edited); rebuild the artifact")
    return manifest


def verify_files(root: Path, manifest: dict[str, Any]) -> None:
    """Every listed file exists inside ``root`` (no ``..``, absolute path or symlink out) with its
    recorded size and sha256."""
    try:
        verify_records(root, manifest.get("files"), manifest=MANIFEST, exhaustive=False)
    except IntegrityError as exc:
        raise ArtifactError(str(exc)) from None


def manifest_sha256(path: str | os.PathLike) -> str:
    """The artifact's identity for allow-lists: sha256 of its ``artifact.json`` (which holds the
    sha256 of every other file)."""
    return _sha256(Path(path) / MANIFEST)


def check_trusted(root: Path, allowlist: set[str] | None) -> None:
    """With an allow-list (``trusted_hashes=`` or ``$FXCOMPILER_TRUSTED_ARTIFACTS``), the artifact's
    manifest hash must be in it."""
    if allowlist is None:
        return
    digest = manifest_sha256(root)
    if digest not in allowlist:
        raise ArtifactError(f"{root / MANIFEST}: sha256 {digest} is not in the trusted-artifact allow-list; "
                            "add it (sha256sum of artifact.json, see docs/security.md) to load this artifact")


def _file(root: Path, manifest: dict, rel: Any, what: str) -> Path:
    """A path named by the manifest: confined to the artifact and one of its verified files."""
    try:
        path = confined(root, rel, what=what)
    except IntegrityError as exc:
        raise ArtifactError(str(exc)) from None
    files = manifest.get("files")
    if not isinstance(files, dict) or rel not in files:
        raise ArtifactError(f"{root / MANIFEST}: {what} {rel!r} is not one of the artifact's listed (hashed) files")
    return path


def _field(root: Path, manifest: dict, key: str) -> Any:
    if key not in manifest:
        raise ArtifactError(f"{root / MANIFEST}: manifest has no {key!r} entry (written by another tool, or edited)")
    return manifest[key]


def read_artifact(path: str | os.PathLike, *, buckets: list[Bucket] | None = None, verify: bool = True,
                  cache_dir: str | os.PathLike | None = None,
                  trusted_hashes: set[str] | None = None) -> ArtifactContents:
    """Load an artifact (the pipelines of ``buckets`` only, when given: they must exist in it).
    ``config``/``generation_config`` of the result are None: load them from ``model_dir``.

    Verify, then execute: every file the manifest lists is hashed and checked *before* any of
    them is parsed or its graph code run, and every path the manifest names must be one of those
    files, inside the artifact. ``trusted_hashes`` (or ``$FXCOMPILER_TRUSTED_ARTIFACTS``, a file of
    hashes) restricts loading to artifacts whose manifest hash is listed. ``verify=False`` skips
    the hashing (paths are still confined): only for artifacts you built yourself."""
    root = Path(path)
    allow = trusted_hashes if trusted_hashes is not None else load_allowlist()
    if allow is not None and not verify:
        raise ArtifactError("verify=False cannot be combined with a trusted-artifact allow-list")
    check_trusted(root, allow)
    manifest = read_manifest(root)
    if verify:
        verify_files(root, manifest)
    return _read_contents(root, manifest, buckets, cache_dir)


def _read_contents(root: Path, manifest: dict, buckets, cache_dir) -> ArtifactContents:
    from .capture import ModelGeometry

    versions = manifest.get("versions", {})
    if versions.get("torch") != torch.__version__:
        log.warning("artifact %s was built with torch %s, running torch %s: fx graph code is portable, "
                    "but check the outputs", root, versions.get("torch"), torch.__version__)
    host = host_description()
    if manifest.get("host", {}).get("isa") not in (None, host["isa"]):
        log.warning("artifact %s was built for CPU ISA %s, this host has %s: its prepacked kernels fall back "
                    "where they cannot run", root, manifest["host"]["isa"], host["isa"])
    pipe_files = {}
    for rel in _field(root, manifest, "pipelines"):
        try:
            data = json.loads(_file(root, manifest, rel, "pipeline file").read_text())
            pipe_files[Bucket(**data["bucket"])] = data
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ArtifactError(f"{root / str(rel)}: malformed pipeline file ({type(exc).__name__}: {exc})") from None
    if buckets is not None:
        missing = [b for b in buckets if b not in pipe_files]
        if missing:
            have = sorted((b.batch_size, b.attention_size, b.kv_cache_size) for b in pipe_files)
            raise ArtifactError(f"bucket_config asks for buckets the artifact lacks: "
                                f"{[(b.batch_size, b.attention_size, b.kv_cache_size) for b in missing]}; "
                                f"it has (batch, attention, kv_cache): {have}")
        pipe_files = {b: pipe_files[b] for b in buckets}
    needed = {blob["id"] for data in pipe_files.values() for blob in data["blobs"].values()}
    graphs = {}
    for blob_id in sorted(needed):
        entry = _field(root, manifest, "graphs").get(blob_id)
        if entry is None:
            raise ArtifactError(f"{root / MANIFEST}: graph blob {blob_id} is used by a pipeline but not listed")
        try:
            code = _file(root, manifest, entry.get("code"), f"graph blob {blob_id} code")
            if entry["kind"] == "dfg":
                from .dfg import deserialize

                graphs[blob_id] = deserialize(code.read_bytes())
                continue
            if entry["kind"] == "edf":
                graphs[blob_id] = _edf_package(root, entry, manifest, cache_dir)
                continue
            if entry["kind"] != "fx":
                raise ArtifactError(f"{root / MANIFEST}: graph blob {blob_id} has unknown kind {entry['kind']!r}")
            consts = load_tensors(_file(root, manifest, entry["constants"], f"graph blob {blob_id} constants"),
                                  entry.get("constant_aliases", {})) if entry.get("constants") else {}
            graphs[blob_id] = load_graph_module(code.read_text(), consts)
        except ArtifactError:
            raise
        except Exception as exc:  # noqa: BLE001 - named and re-raised
            raise ArtifactError(f"{root / str(entry.get('code'))}: cannot load graph blob "
                                f"({type(exc).__name__}: {exc})") from exc
    pipelines = []
    for bucket, data in pipe_files.items():
        try:
            pipelines.append(pipeline_from_dict(data, graphs))
        except ValueError as exc:
            raise ArtifactError(f"{root / 'pipelines' / bucket_file_name(bucket)}: {exc}") from None
    prm = _field(root, manifest, "params")
    pfile = _file(root, manifest, prm.get("file"), "parameter file")
    try:
        if prm["format"] == "safetensors":
            params = load_tensors(pfile, prm.get("aliases", {}))
        else:
            params = torch.load(pfile, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise ArtifactError(f"{pfile}: cannot read parameters ({exc})") from exc
    for pipe in pipelines:
        for k in pipe.param_files:
            pipe.param_files[k] = type(pipe.param_files[k])(str(pfile), prm["format"])
    g = dict(_field(root, manifest, "geometry"))
    try:
        g["dtype"] = getattr(torch, g["dtype"])
        geometry = ModelGeometry(**g)
    except (KeyError, TypeError, AttributeError) as exc:
        raise ArtifactError(f"{root / MANIFEST}: malformed 'geometry' entry ({type(exc).__name__}: {exc})") from None
    # config / generation config are left to the caller (LLM loads them on first use)
    return ArtifactContents(_field(root, manifest, "model")["id"], None, None, None, pipelines, params,
                            geometry, dict(_field(root, manifest, "settings")), list(manifest.get("passes", [])),
                            manifest, root / "model")


def _edf_package(root: Path, entry: dict, manifest: dict, cache_dir):
    """The artifact's AOTInductor package, or (announced) a recompilation of its fx source when
    the package was built by another torch version or for another CPU ISA (packages are native
    code tied to both)."""
    from . import edf

    versions = manifest.get("versions", {})
    built_isa, host_isa = manifest.get("host", {}).get("isa"), host_description()["isa"]
    same_isa = entry["device_type"] != "cpu" or built_isa in (None, host_isa)
    if versions.get("torch") == torch.__version__ and same_isa:
        code = _file(root, manifest, entry["code"], "edf package")
        return edf.deserialize(code.read_bytes(), entry["key"], cache_dir, entry["device_type"])
    why = (f"torch {versions.get('torch')} (this is {torch.__version__})" if versions.get("torch") != torch.__version__
           else f"CPU ISA {built_isa} (this host: {host_isa})")
    if "source" not in entry:
        raise ArtifactError(f"{root / entry['code']}: built for {why} and the artifact has no fx source to "
                            "recompile it from")
    consts = load_tensors(_file(root, manifest, entry["constants"], "edf source constants"),
                          entry.get("constant_aliases", {})) if entry.get("constants") else {}
    gm = load_graph_module(_file(root, manifest, entry["source"], "edf fx source").read_text(), consts)
    log.warning("recompiling edf package %s for this host (the artifact's was built for %s)", entry["code"], why)
    from .graph_io import restore_meta
    from .pipeline import DataBlob

    if entry.get("signature") is None:
        raise ArtifactError(f"{root / entry['source']}: no placeholder signature to recompile the edf package from")
    restore_meta(gm, entry["signature"])

    blob = DataBlob(Path(entry["code"]).stem, "fx", gm)
    return edf.to_edf_blob(blob, cache_dir, entry["device_type"]).graph
