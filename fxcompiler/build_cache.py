"""Build cache: the fx pipelines built from a cached optimised program, stored beside it.

A compile-cache hit (:mod:`fxcompiler.compile_cache`) gives back the optimised graph; building
the bucket pipelines from it still needs every node's ``meta['val']`` (re-derived by fake
propagation over the whole graph) and the blockwise partition. Both are deterministic
functions of the program and the build settings, so their result — the fx pipelines and
their (few, shared) blob graphs — is cached too, in
``cache_dir/compiled/<program key>/builds/<build key>/``:

- ``pipelines.json``: the :class:`~fxcompiler.pipeline.Pipeline` records without their graphs, in the
  compact form of :func:`~fxcompiler.pipeline.pipelines_to_compact` (what the buckets share stored
  once: SmolLM2's 277 pipelines are 1 MB there, decoded in 0.16 s under cProfile, against 27 MB
  and 1.2 s as plain records). JSON, never pickle: a cache entry is data, and unpickling runs code;
- ``graphs/<blob id>.py`` (+ ``.constants.safetensors``): each unique blob's code
  (:mod:`fxcompiler.graph_io`) and ``blobs.json`` its placeholder signature, so the later
  ``dfg``/``edf`` conversions can give a blob its ``meta['val']`` back cheaply.

The build key hashes the program key, model name, buckets, KV block size, device and the
build options (blockwise settings and the compiler options); the program key already covers the code, torch and
transformers versions. Entries are written to a temporary directory and renamed; every file is
recorded in ``checksums.json`` and verified before anything is read (verify, then execute); an
entry that fails verification or cannot be read is removed with a warning and rebuilt, never used.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from . import graph_io
from .compile_cache import gc_paused, load_tensors, save_tensors, write_entry
from .integrity import StampStore, stamp_store, verify_checksums, write_checksums
from .pipeline import Bucket, DataBlob, Pipeline, pipelines_from_compact, pipelines_to_compact

log = logging.getLogger("fxcompiler.cache")

BUILD_SCHEMA_VERSION = 3  # 3: compact pipelines.json; 2: plain records + checksums.json (1: a pickle)


def build_key(program_key: str, model_name: str, buckets: list[Bucket], *, block_size: int, device: str,
              options: dict[str, Any]) -> str:
    """Key of the pipelines built from ``program_key`` with these settings."""
    inputs = {"schema": BUILD_SCHEMA_VERSION, "program": program_key, "model": model_name,
              "buckets": [asdict(b) for b in buckets], "block_size": block_size, "device": device,
              "options": options}  # all of them: a new build option is keyed before anyone remembers to
    text = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class BuildCache:
    """``cache_dir/compiled/<program key>/builds/<build key>/`` entries of built fx pipelines."""

    def __init__(self, cache_dir: str | os.PathLike, program_key: str):
        self.cache_dir = Path(cache_dir)
        self.root = self.cache_dir / "compiled" / program_key / "builds"

    def path(self, key: str) -> Path:
        return self.root / key

    def load(self, key: str) -> list[Pipeline] | None:
        """The cached pipelines (blob graphs loaded, signatures in ``gm.meta``), or None."""
        entry = self.path(key)
        from .integrity import remove_stale_temps

        remove_stale_temps(self.root, ".tmp-")  # entries a killed writer left half-written
        if not entry.is_dir():
            return None
        try:
            with gc_paused():
                return _read(entry, stamp_store(self.cache_dir))
        except Exception as exc:  # noqa: BLE001 - a damaged entry is rebuilt, never trusted
            log.warning("build cache entry %s is unreadable (%s); rebuilding it", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
            return None

    def store(self, key: str, pipelines: list[Pipeline]) -> bool:
        """Write the pipelines (fx blobs only); False when a blob cannot be stored."""
        entry = self.path(key)
        if entry.exists():
            return True
        if not (self.root.parent / "program.json").is_file():  # the program itself was not cached
            return False
        blobs = {b.id: b for p in pipelines for b in p.blobs.values()}
        signatures = {}
        for bid, blob in blobs.items():
            if blob.kind != "fx" or not isinstance(blob.graph, torch.fx.GraphModule):
                return False
            signatures[bid] = graph_io.placeholder_signature(blob.graph)
            if signatures[bid] is None:  # its meta could not be restored later
                return False
        def write(tmp: Path) -> None:
            (tmp / "graphs").mkdir(parents=True)
            index = {}
            for bid, blob in blobs.items():
                (tmp / "graphs" / f"{bid}.py").write_text(graph_io.graph_module_source(blob.graph))
                consts = graph_io.graph_constants(blob.graph)
                aliases = save_tensors(consts, tmp / "graphs" / f"{bid}.constants.safetensors") if consts else None
                index[bid] = {"signature": signatures[bid], "constant_aliases": aliases}
            (tmp / "blobs.json").write_text(json.dumps(index, sort_keys=True))
            compact = pipelines_to_compact(pipelines)
            (tmp / "pipelines.json").write_text(json.dumps({"schema": BUILD_SCHEMA_VERSION, **compact}))
            write_checksums(tmp)

        write_entry(entry, write, "build cache")
        return True


def _read(entry: Path, stamps: StampStore | None = None) -> list[Pipeline]:
    verify_checksums(entry, stamps=stamps)  # before any file of the entry is parsed or its code run
    data = json.loads((entry / "pipelines.json").read_text())
    if not isinstance(data, dict) or data.get("schema") != BUILD_SCHEMA_VERSION:
        raise ValueError(f"pipelines.json is not a build-cache schema {BUILD_SCHEMA_VERSION} entry")
    index = json.loads((entry / "blobs.json").read_text())
    graphs = {}
    for bid, info in index.items():
        if not graph_io.is_safe_name(bid):
            raise ValueError(f"blobs.json names blob {bid!r}, not a plain identifier")
        consts = {}
        if info["constant_aliases"] is not None:
            consts = load_tensors(entry / "graphs" / f"{bid}.constants.safetensors", info["constant_aliases"])
        gm = graph_io.load_graph_module((entry / "graphs" / f"{bid}.py").read_text(), consts)
        gm.meta["fxc_signature"] = info["signature"]
        graphs[bid] = gm
    return pipelines_from_compact(data, graphs)


def ensure_meta(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Give a graph loaded from a cache its ``meta['val']`` back (once), from the placeholder
    signature stored with it; graphs that already have it are returned as they are."""
    signature = gm.meta.get("fxc_signature")
    if signature is None:
        return gm
    if not all("val" in n.meta for n in gm.graph.nodes if n.op == "placeholder"):
        graph_io.restore_meta(gm, signature)
    del gm.meta["fxc_signature"]
    return gm
