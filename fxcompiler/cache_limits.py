"""Cache size: measure the cache folder and keep it under a limit by removing least-recently-used entries.

Every cache under ``cache_dir`` keeps one *entry* per top-level name of its folder, written whole by a
rename and never changed in place afterwards (``builds/`` grows inside a ``compiled/`` entry):
``compiled/<key>/`` and ``captured/<key>/`` (:mod:`fxcompiler.compile_cache`, with the build cache's
``builds/`` inside), ``edf/<key>.pt2`` (a file, with its ``<key>.pt2.sha256`` record beside it),
``models/<id>-<digest>/`` and ``models/qckpt-<digest>/`` (GGUF and pre-quantised conversions),
``kernels/<name>/`` (C++ kernel builds) and ``model_info/<key>/``. This module knows only that
layout, never the caches' code (the kernels' builder lives in ``backends/``, which ``fxcompiler/`` must
not import), so it is the same rule for every kind: a top-level name is an entry unless it is a
temporary (a name beginning with ``.`` or holding ``.tmp-``) or a lock (``*.lock``); ``<entry>.sha256``
goes with its entry.

Recency is the entry's modification time. A hit calls :func:`mark_used`, which sets it to now with
``os.utime`` on the entry itself (the folder, not a file inside it: no file's content, size, mtime or
ctime changes, so ``checksums.json``, the verified-stamp store and the model-files identity that keys
compiled programs all stay valid, and no marker file appears for :func:`~fxcompiler.integrity.verify_checksums`
to refuse). Kernel libraries are loaded by ``backends/``; :func:`touch_mapped` marks whatever entry a
file mapped into this process lives in (``/proc/self/maps``), which the composition root calls.

Removal (:func:`prune`) is safe against readers and writers in other processes: an entry is first
renamed, atomically, to a ``.tmp-<pid>-...`` sibling (the name :func:`~fxcompiler.integrity.remove_stale_temps`
removes once this process is gone, should it die mid-way) and only then deleted, so a reader finds the
whole entry or none (a miss: the caches rebuild it; one reading while it goes logs the entry unreadable
and rebuilds). An entry whose sibling lock (``<name>.lock`` or ``.<name>.lock``: the kernel and model
conversions' builders) is held is left alone. Files already open or mapped keep working (unlinked
inodes live on).

Requires: ``cache_dir`` is a folder this user may write to (or absent: nothing to do).
Ensures: :func:`prune` never removes an entry given in ``keep``, one this process marked used or
stored, or one it has mapped; never follows a symlink (sizes use ``lstat``; a symlinked entry is
removed as a link; a kind folder that is a symlink is neither measured nor pruned); and leaves the total
at or under ``max_bytes`` unless protected entries alone exceed it. The size limit comes from
``FXCOMPILER_CACHE_MAX_SIZE`` (:func:`max_size`; bad values raise a ``ValueError`` naming the variable).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("fxcompiler.cache")

KINDS = ("compiled", "captured", "edf", "models", "kernels", "model_info")  # folders under cache_dir it manages
ENV = "FXCOMPILER_CACHE_MAX_SIZE"
DEFAULT_MAX_BYTES = 20 << 30  # 20 GiB; see docs/architecture.md ("Cache size")
_SIDECARS = (".sha256",)  # "<entry><suffix>" files that belong to an entry (edf's package records)

_used: set[Path] = set()  # entries this process loaded or stored (normalised): never pruned by it


def default_cache_dir() -> Path:
    """``$FXCOMPILER_CACHE_DIR``, else ``$XDG_CACHE_HOME/fxcompiler``, else ``~/.cache/fxcompiler``."""
    root = os.environ.get("FXCOMPILER_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))) / "fxcompiler"


@dataclass(frozen=True)
class CacheEntry:
    """One cache entry: ``kind`` (its folder under cache_dir), ``path``, ``bytes`` allocated on disk
    (``st_blocks * 512``, its sidecars included) and ``last_used`` (epoch seconds: its mtime)."""

    kind: str
    path: Path
    bytes: int
    last_used: float
    sidecars: tuple[Path, ...] = ()


@dataclass
class PruneReport:
    """What :func:`prune` removed (or, with ``dry_run``, would remove) and the totals around it."""

    removed: list[CacheEntry] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    busy: list[CacheEntry] = field(default_factory=list)  # locked by a builder, or gone meanwhile: left
    dry_run: bool = False

    @property
    def freed(self) -> int:
        return self.bytes_before - self.bytes_after


# --------------------------------------------------------------------------- sizes


_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?)?b?", re.IGNORECASE)


def parse_size(text: str, *, what: str = ENV) -> int | None:
    """Bytes of a size written as ``20G``, ``500M``, ``1.5GiB`` or plain bytes (``k/M/G/T`` powers of 1000,
    ``Ki/Mi/Gi/Ti`` powers of 1024, an optional trailing ``B``; case ignored, as ccache reads them); ``0`` or
    ``none`` is no limit (None). ``what`` names the setting in the ValueError a bad value raises."""
    s = str(text).strip()
    if s.lower() in ("none", "unlimited"):
        return None
    m = _SIZE.fullmatch(s)
    if m is None:
        raise ValueError(f"{what}={text!r} is not a size: expected bytes (e.g. 21474836480), a number with a unit "
                         f"(500M, 20G, 1.5GiB: k/M/G/T are powers of 1000, KiB/MiB/GiB/TiB powers of 1024), "
                         f"or 0 / none for no limit")
    number, unit = m.group(1), _UNITS[(m.group(2) or "").lower()]
    value = int(float(number) * unit) if "." in number else int(number) * unit
    return value or None


def max_size() -> int | None:
    """The cache size limit in bytes: ``$FXCOMPILER_CACHE_MAX_SIZE`` (unset or empty: :data:`DEFAULT_MAX_BYTES`;
    ``0`` / ``none``: None, no limit)."""
    text = os.environ.get(ENV, "").strip()
    return DEFAULT_MAX_BYTES if not text else parse_size(text, what=ENV)


def format_bytes(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``3.2 MiB``, ``17.1 GiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _allocated(path: str) -> int:
    """Bytes allocated to ``path`` and, for a folder, everything under it (``lstat``: links not followed)."""
    st = os.lstat(path)
    total = st.st_blocks * 512
    if not os.path.isdir(path) or os.path.islink(path):
        return total
    stack = [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        total += e.stat(follow_symlinks=False).st_blocks * 512
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                    except FileNotFoundError:  # removed while we looked
                        continue
        except (FileNotFoundError, NotADirectoryError):
            continue
    return total


def _is_entry_name(name: str) -> bool:
    return not (name.startswith(".") or ".tmp-" in name or name.endswith(".lock"))


def _kind_dir(root: Path, kind: str) -> Path | None:
    d = root / kind
    return d if d.is_dir() and not d.is_symlink() else None


def cache_usage(cache_dir: str | os.PathLike, kinds: Iterable[str] = KINDS) -> list[CacheEntry]:
    """Every entry of the ``kinds`` folders of ``cache_dir``, oldest ``last_used`` first (an absent folder
    has none). One ``lstat`` per file: ~14 ms for 413 entries, 2,600 files and 18 GiB (warm dentries)."""
    root = _root(cache_dir)
    out = []
    for kind in kinds:
        d = _kind_dir(root, kind)
        if d is None:
            continue
        names = set(os.listdir(d))
        for name in names:
            if not _is_entry_name(name) or any(name.endswith(s) and name[: -len(s)] in names for s in _SIDECARS):
                continue
            path = d / name
            sidecars = tuple(d / f"{name}{s}" for s in _SIDECARS if f"{name}{s}" in names)
            try:
                size = _allocated(str(path)) + sum(_allocated(str(s)) for s in sidecars)
                mtime = os.lstat(path).st_mtime
            except FileNotFoundError:  # removed while we looked
                continue
            out.append(CacheEntry(kind, path, size, mtime, sidecars))
    out.sort(key=lambda e: e.last_used)
    return out


def unmanaged_usage(cache_dir: str | os.PathLike) -> dict[str, int]:
    """Bytes of each folder under ``cache_dir`` this module does not manage (``autotune``, ``verified``, ...)."""
    root = _root(cache_dir)
    if not root.is_dir():
        return {}
    return {p.name: _allocated(str(p)) for p in sorted(root.iterdir()) if p.name not in KINDS}


# --------------------------------------------------------------------------- recency and protection


def _root(cache_dir: str | os.PathLike) -> Path:
    """``cache_dir`` with its own symlinks resolved (the folder the user chose), so entries compare by path."""
    return Path(os.path.realpath(cache_dir))


def _norm(path: str | os.PathLike) -> Path:
    """An entry path with its parent resolved but not itself (a symlinked entry stays the link)."""
    p = Path(os.path.abspath(path))
    return Path(os.path.realpath(p.parent)) / p.name


def mark_used(entry: str | os.PathLike) -> None:
    """Record a cache hit (or store) of ``entry``: its mtime becomes now, and this process never prunes it.
    Best effort: an entry removed meanwhile, or a cache folder this user may not change, is left as it is."""
    entry = _norm(entry)
    _used.add(entry)
    with contextlib.suppress(OSError):
        os.utime(entry, follow_symlinks=False)


def _mapped_files() -> list[str]:
    """Paths of the files mapped into this process (shared libraries, mapped parameters); [] off Linux."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = set()
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            out.add(parts[5].removesuffix(" (deleted)"))
    return sorted(out)


def _entries_of(paths: Iterable[str], cache_dir: str | os.PathLike, kinds: Iterable[str] = KINDS) -> set[Path]:
    root = str(_root(cache_dir))
    kinds = set(kinds)
    out = set()
    for p in paths:
        if p.startswith(root + os.sep):
            rel = p[len(root) + 1:].split(os.sep)
            if len(rel) >= 2 and rel[0] in kinds:
                out.add(Path(root, rel[0], rel[1]))
    return out


def touch_mapped(cache_dirs: Iterable[str | os.PathLike]) -> list[Path]:
    """:func:`mark_used` every entry of ``cache_dirs`` that holds a file mapped into this process (the C++
    kernel libraries ``backends/`` loaded, parameters mapped from a compiled entry); returns them."""
    mapped = _mapped_files()
    found = sorted({e for d in cache_dirs if d is not None for e in _entries_of(mapped, d)})
    for e in found:
        mark_used(e)
    return found


def in_use(cache_dir: str | os.PathLike) -> set[Path]:
    """Entries of ``cache_dir`` this process must not remove: marked used or stored here, or mapped."""
    root = _root(cache_dir)
    used = frozenset(_used)  # a copy taken at once: another thread may mark an entry meanwhile
    return {e for e in used if root in e.parents} | _entries_of(_mapped_files(), cache_dir)


# --------------------------------------------------------------------------- removal


@contextlib.contextmanager
def _unless_locked(path: Path) -> Iterator[bool]:
    """Hold the entry's sibling builder locks (``<name>.lock``, ``.<name>.lock``) that exist, without waiting;
    yields False when one is held by another process (a build or load of this entry is under way)."""
    fds = []
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield True
        return
    try:
        for lock in (path.with_name(f"{path.name}.lock"), path.with_name(f".{path.name}.lock")):
            try:
                fd = os.open(lock, os.O_RDONLY)
            except OSError:
                continue
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                yield False
                return
        yield True
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _remove(entry: CacheEntry) -> bool:
    """Rename ``entry`` to a ``.tmp-<pid>-`` sibling (atomic: readers see all of it or nothing), then delete
    it and its sidecars. False when it is locked by a builder, already gone or cannot be moved."""
    path = entry.path
    tmp = path.with_name(f".tmp-{os.getpid()}-prune-{path.name}-{uuid.uuid4().hex[:8]}")
    with _unless_locked(path) as free:
        if not free:
            return False
        try:
            os.rename(path, tmp)
        except OSError:  # gone meanwhile (another pruner), or not ours to move
            return False
    if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.unlink(missing_ok=True)
    for s in entry.sidecars:
        with contextlib.suppress(OSError):
            s.unlink()
    return True


def prune(cache_dir: str | os.PathLike, max_bytes: int | None, *, keep: Iterable[str | os.PathLike] = (),
          older_than: float | None = None, kinds: Iterable[str] = KINDS, dry_run: bool = False) -> PruneReport:
    """Remove least-recently-used entries of ``cache_dir`` until their total is at most ``max_bytes`` (None:
    no size bound), and every entry unused for more than ``older_than`` seconds. ``keep`` (entry paths),
    entries this process used or stored and entries it has mapped are never removed; ``kinds`` limits
    which folders are considered; ``dry_run`` removes nothing and reports what would go."""
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
    if older_than is not None and not older_than >= 0:
        raise ValueError(f"older_than must be a non-negative number of seconds or None, got {older_than!r}")
    kinds = tuple(kinds)
    if unknown := [k for k in kinds if k not in KINDS]:
        raise ValueError(f"kinds: unknown cache kind(s) {unknown}; expected some of {list(KINDS)}")
    entries = cache_usage(cache_dir, kinds)
    protected = in_use(cache_dir) | {_norm(p) for p in keep}
    total = sum(e.bytes for e in entries)
    report = PruneReport(bytes_before=total, dry_run=dry_run)
    now = time.time()
    if not dry_run:
        from .integrity import remove_stale_temps

        root = _root(cache_dir)
        for kind in kinds:  # what a killed writer or pruner left
            if (d := _kind_dir(root, kind)) is not None:
                remove_stale_temps(d, ".tmp-")
    for e in entries:  # oldest first
        over = max_bytes is not None and total > max_bytes
        old = older_than is not None and now - e.last_used > older_than
        if not (over or old):  # entries come oldest first and the total only falls: nothing later qualifies
            break
        if _norm(e.path) in protected:
            continue
        if dry_run or _remove(e):
            report.removed.append(e)
            total -= e.bytes
        else:
            report.busy.append(e)
    report.bytes_after = total
    return report


def enforce_limit(cache_dir: str | os.PathLike | None, *, keep: Iterable[str | os.PathLike] = ()) -> PruneReport | None:
    """The automatic prune after a new entry is stored: :func:`prune` to :func:`max_size` (None when there is
    no limit or no cache folder), logged at INFO with what went and the bytes freed. A file system error is
    logged, never raised: the entry was stored, the build goes on."""
    if cache_dir is None:
        return None
    limit = max_size()
    if limit is None:
        return None
    t0 = time.perf_counter()
    try:
        report = prune(cache_dir, limit, keep=keep)
    except OSError as exc:
        log.warning("cache size limit: could not prune %s (%s)", cache_dir, exc)
        return None
    if report.removed:
        log.info("cache size limit %s (%s): removed %d least recently used entries, %s freed (%s -> %s, %.3fs): %s",
                 format_bytes(limit), ENV, len(report.removed), format_bytes(report.freed),
                 format_bytes(report.bytes_before), format_bytes(report.bytes_after), time.perf_counter() - t0,
                 ", ".join(f"{e.kind}/{e.path.name} ({format_bytes(e.bytes)})" for e in report.removed))
    if report.bytes_after > limit:
        log.info("cache size limit %s: %s still held by entries in use, locked or kept", format_bytes(limit),
                 format_bytes(report.bytes_after))
    return report
