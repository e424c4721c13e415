"""Compile cache: the optimised program (graph after the pass pipeline + its parameters),
stored in ``cache_dir/compiled/<key>/`` and keyed by everything that determines it.

A second ``LLM(...)`` with the same model, dtype, overrides, passes, device and
compiler/torch/transformers versions loads the optimised graph and its (already
prepacked) parameters instead of loading the checkpoint, exporting and running the
passes again. The key is computed *before* anything is loaded, from the model files'
identity (config contents, weight file names, sizes and modification times), so a hit
costs only reading the parameters back. Options that cannot be fingerprinted (a user
pass given as a Python object without a ``cache_key``) or that ask to watch the passes
run (``dump_dir``, ``numeric_check``) bypass the cache.

Entry layout: ``program.json`` (key inputs, input specs, geometry, placeholder signature,
pass history), ``graph.py`` (see :mod:`fxcompiler.graph_io`), ``constants.safetensors``,
``params.safetensors``, and ``checksums.json`` (size and sha256 of each: verified before any
file is parsed or the graph code run; an entry that fails is removed and rebuilt). Entries
are written to a temporary directory and renamed, so a crash never leaves a half-written
entry behind. A hit marks the entry used and a new entry prunes the least recently used others
down to the cache size limit (:mod:`fxcompiler.cache_limits`).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import graph_io
from .cache_limits import enforce_limit, mark_used
from .capture import InputSpec, ModelGeometry
from .integrity import StampStore, stamp_store, verify_checksums, write_checksums
from .pass_manager import CompileContext

log = logging.getLogger("fxcompiler.cache")

CACHE_SCHEMA_VERSION = 1
_PACKAGES = ("fxcompiler", "passes", "backends")


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """Hash of the compiler's own sources (Python and C++): any code change is a new key."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for pkg in _PACKAGES:
        for path in sorted((root / pkg).rglob("*")):
            if path.suffix in (".py", ".cpp", ".h") and "__pycache__" not in path.parts:
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
    return h.hexdigest()


@contextlib.contextmanager
def gc_paused():
    """The cyclic garbage collector paused (and restored as it was): decoding a cached program or build
    allocates tens of thousands of objects and no garbage, and each collection it triggers walks the
    whole heap (torch's modules, the graphs): ~0.15 s of a warm start."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _json_default(obj: Any) -> Any:
    key = getattr(obj, "cache_key", None)
    if isinstance(key, str):
        return {"cache_key": key}
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"{type(obj).__name__} cannot be fingerprinted")


def options_fingerprint(options: dict[str, Any]) -> str | None:
    """Canonical JSON of the compiler options, or None when they cannot be fingerprinted."""
    if options.get("dump_dir") or options.get("numeric_check") or options.get("bisect") \
            or os.environ.get("FXCOMPILER_BISECT", "0") not in ("", "0") \
            or _imports_a_pass(options.get("passes")):
        # dumps/checks must see the passes run; a "module:attr" pass's source is not fingerprinted
        return None
    try:
        return json.dumps(options, sort_keys=True, default=_json_default)
    except (TypeError, ValueError):
        return None


def _imports_a_pass(spec: Any) -> bool:
    """Whether a passes override names a pass by import path ("module:attribute")."""
    from .pass_manager import parse_passes_spec

    try:
        spec = parse_passes_spec(spec)
    except ValueError:
        return False
    for item in spec.get("insert", ()):
        ref = item.get("pass") if isinstance(item, dict) else item[0] if isinstance(item, (tuple, list)) else item
        if isinstance(ref, str) and ":" in ref:
            return True
    return False


def model_files_identity(model_dir: Path) -> list[list]:
    """Contents of the small config files and (name, size, mtime) of everything else."""
    out = []
    for path in sorted(p for p in model_dir.iterdir() if p.is_file()):
        st = path.stat()
        if path.suffix == ".json" and st.st_size < (1 << 20):
            out.append([path.name, hashlib.sha256(path.read_bytes()).hexdigest()])
        else:
            out.append([path.name, st.st_size, st.st_mtime_ns])
    return out


@functools.lru_cache(maxsize=1)
def _transformers_version() -> str:
    """transformers' version from its package metadata (importing it costs a warm start ~0.6 s)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:  # a source checkout without metadata
        import transformers

        return transformers.__version__


def program_key(**inputs: Any) -> str:
    """Content key of one optimised program (``inputs`` must be JSON-serialisable)."""
    full = {"schema": CACHE_SCHEMA_VERSION, "code": code_fingerprint(), "torch": torch.__version__,
            "transformers": _transformers_version(), **inputs}
    text = json.dumps(full, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _dedupe(params: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors to store (one per distinct view) and aliases name -> stored name (tied weights)."""
    stored, aliases, seen = {}, {}, {}
    for name, t in params.items():
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if view in seen and t.numel():
            aliases[name] = seen[view]
            continue
        seen[view] = name
        stored[name] = t
    ptrs: dict[int, int] = {}
    for t in stored.values():
        ptrs[t.untyped_storage().data_ptr()] = ptrs.get(t.untyped_storage().data_ptr(), 0) + 1
    return ({k: (v.detach().clone() if ptrs[v.untyped_storage().data_ptr()] > 1 else v.detach()).contiguous()
             for k, v in stored.items()}, aliases)


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, str]:
    """Write tensors with safetensors (shared views stored once); returns the alias map."""
    from safetensors.torch import save_file

    stored, aliases = _dedupe(tensors)
    save_file(stored, str(path))
    return aliases


def load_tensors(path: Path, aliases: dict[str, str], *, region: bool = False,
                 mapped: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of ``path`` with the alias names added; ``region``: read into one page-aligned
    mapping (:mod:`fxcompiler.param_memory`) that the CPU backend backs with huge pages in place;
    ``mapped``: views of a private mapping of the (verified) file, read only when touched."""
    from .models.safetensors_reader import read_safetensors

    out = read_safetensors(path, region=region, mapped=mapped)
    for name, target in aliases.items():
        if target not in out:
            raise ValueError(f"{path}: alias {name!r} points at missing tensor {target!r}")
        out[name] = out[target]
    return out


def save_program(directory: Path, gm: torch.fx.GraphModule, ctx: CompileContext, extra: dict | None = None,
                 *, node_names: bool = False) -> None:
    """Write an optimised program to ``directory`` (which must not exist yet). ``node_names``: record every
    node's name, so that :func:`load_program` gives the loaded nodes the names they had."""
    directory.mkdir(parents=True)
    (directory / "graph.py").write_text(graph_io.graph_module_source(gm))
    constants = graph_io.graph_constants(gm)
    const_aliases = save_tensors(constants, directory / "constants.safetensors") if constants else {}
    aliases = save_tensors(ctx.params, directory / "params.safetensors")
    g = ctx.geometry
    meta = {
        "schema": CACHE_SCHEMA_VERSION,
        "input_specs": [[s.name, s.kind, s.target] for s in ctx.input_specs],
        "geometry": {"num_layers": g.num_layers, "num_kv_heads": g.num_kv_heads, "head_dim": g.head_dim,
                     "vocab_size": g.vocab_size, "dtype": str(g.dtype).removeprefix("torch."),
                     "max_position_embeddings": g.max_position_embeddings},
        "signature": graph_io.placeholder_signature(gm),
        "param_aliases": aliases, "constant_aliases": const_aliases, "constants": bool(constants),
        "graph_meta": {k: dict(v) for k, v in gm.meta.items() if k == "fxc_constants"},
        "history": [dict(h) for h in ctx.history],  # records are JSON (PassManager enforces it)
        **({"node_names": [n.name for n in gm.graph.nodes]} if node_names else {}),
        **(extra or {}),
    }
    (directory / "program.json").write_text(json.dumps(meta, indent=1, sort_keys=True, default=str))
    write_checksums(directory)


def load_program(directory: Path, *, restore_meta: bool = True, stamps: StampStore | None = None,
                 lazy_graph: bool = False) -> tuple[torch.fx.GraphModule, CompileContext]:
    """Read back what :func:`save_program` wrote. ``meta['val']`` is re-derived by fake propagation
    (seconds for a real model) unless ``restore_meta=False``, which leaves the placeholder
    signature in ``gm.meta['fxc_signature']`` for :func:`fxcompiler.build_cache.ensure_meta`.
    ``stamps``: files hashed before and unchanged since are not hashed again (:class:`StampStore`).
    ``lazy_graph`` (with ``restore_meta=False``): the graph is a :class:`~fxcompiler.graph_io.DeferredGraphModule`,
    built from the verified source held in memory when first used (a build-cache hit never uses it)."""
    verify_checksums(directory, exclude=("builds/", ".tmp-"), stamps=stamps)  # verify, then execute (graph.py is code)
    meta = json.loads((directory / "program.json").read_text())
    if meta.get("schema") != CACHE_SCHEMA_VERSION:
        raise ValueError(f"{directory}: program schema {meta.get('schema')} != {CACHE_SCHEMA_VERSION}")
    if meta["signature"] is None:
        raise ValueError(f"{directory}: the program has no placeholder signature to restore shapes from")
    constants = load_tensors(directory / "constants.safetensors", meta["constant_aliases"]) if meta["constants"] else {}
    source = (directory / "graph.py").read_text()  # the verified bytes: a deferred build never reads the file again

    def graph() -> torch.fx.GraphModule:
        gm = graph_io.load_graph_module(source, constants, node_names=meta.get("node_names"))
        if "fxc_constants" in meta["graph_meta"]:
            gm.meta["fxc_constants"] = dict(meta["graph_meta"]["fxc_constants"])  # attribute -> parameter FQN
        if restore_meta:
            graph_io.restore_meta(gm, meta["signature"])
        else:  # restored on demand by fxcompiler.build_cache.ensure_meta
            gm.meta["fxc_signature"] = meta["signature"]
        return gm

    gm = graph_io.DeferredGraphModule(graph) if lazy_graph and not restore_meta else graph()
    params = load_tensors(directory / "params.safetensors", meta["param_aliases"], region=True,  # verified above
                          mapped=os.environ.get("FXCOMPILER_MAP_PARAMS", "1") != "0")
    g = dict(meta["geometry"])
    g["dtype"] = getattr(torch, g["dtype"])
    ctx = CompileContext([InputSpec(*s) for s in meta["input_specs"]], params, ModelGeometry(**g),
                         history=list(meta.get("history", [])))
    return gm, ctx


class CompileCache:
    """``cache_dir/compiled/<key>/`` entries of optimised programs."""

    DIRECTORY = "compiled"  # under cache_dir
    WHAT = "compile cache"  # in warnings

    def __init__(self, cache_dir: str | os.PathLike):
        self.cache_dir = Path(cache_dir)
        self.root = self.cache_dir / self.DIRECTORY

    def path(self, key: str) -> Path:
        return self.root / key

    def load(self, key: str, *, restore_meta: bool = True,
             lazy_graph: bool = False) -> tuple[torch.fx.GraphModule, CompileContext] | None:
        entry = self.path(key)
        from .integrity import remove_stale_temps

        remove_stale_temps(self.root, ".tmp-")  # entries a killed writer left half-written
        if not (entry / "program.json").is_file():
            if entry.exists():  # entries appear whole (a renamed directory): this one was damaged
                log.warning("%s entry %s has no program.json; removing it", self.WHAT, entry)
                shutil.rmtree(entry, ignore_errors=True)
            return None
        t0 = time.perf_counter()
        try:
            with gc_paused() if not restore_meta else contextlib.nullcontext():  # fake propagation makes garbage
                program = load_program(entry, restore_meta=restore_meta, stamps=stamp_store(self.cache_dir),
                                       lazy_graph=lazy_graph)
        except Exception as exc:  # noqa: BLE001 - a damaged entry is rebuilt, never trusted
            log.warning("%s entry %s is unreadable (%s); rebuilding it", self.WHAT, entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
            return None
        log.info("%s hit %s (%.2fs)", self.WHAT, key, time.perf_counter() - t0)
        mark_used(entry)  # recency for the size limit (fxcompiler.cache_limits)
        return program

    def store(self, key: str, gm: torch.fx.GraphModule, ctx: CompileContext, extra: dict | None = None) -> None:
        written = write_entry(self.path(key), lambda tmp: save_program(tmp, gm, ctx, extra), self.WHAT)
        stamps = stamp_store(self.cache_dir)
        entry = self.path(key)
        if stamps is not None and (entry / "checksums.json").is_file():  # the next start then hashes nothing
            stamps.settle(sorted(f for f in entry.iterdir() if f.is_file() and f.name != "checksums.json"))
        self._stored(entry, written)

    def _stored(self, entry: Path, written: bool) -> None:
        """After a store: ``entry`` counts as used, and a new entry may take the cache over its size limit
        (``FXCOMPILER_CACHE_MAX_SIZE``), so the least recently used others are pruned (never this one)."""
        mark_used(entry)
        if written:
            enforce_limit(self.cache_dir, keep=(entry,))


def write_entry(entry: Path, write: Callable[[Path], None], what: str) -> bool:
    """Write the cache entry directory ``entry`` atomically: ``write(tmp)`` creates and fills a
    temporary sibling (its parents included), which is then renamed to ``entry``. An existing
    entry is kept (a concurrent writer got there first); a failed write is logged, never left.
    Returns whether this call put a new entry in place."""
    if entry.exists():
        return False
    from .integrity import remove_stale_temps

    remove_stale_temps(entry.parent, ".tmp-")  # left by a writer that was killed
    tmp = entry.parent / f".tmp-{os.getpid()}-{entry.name}-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        os.replace(tmp, entry)
        return True
    except OSError as exc:
        if not entry.exists():
            log.warning("could not write %s entry %s: %s", what, entry, exc)
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
