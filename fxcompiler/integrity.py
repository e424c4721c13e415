"""Verify, then execute: file checksums, confined paths and trusted cache folders.

Artifacts and cache entries hold Python graph code, native packages and tensors. Nothing in
them is parsed, imported or executed before every file it consists of has been hashed and
compared with its record (:func:`verify_checksums`, :func:`write_checksums`), and every path
a manifest names is resolved inside its root (:func:`confined`: no absolute paths, no ``..``,
no symlinks that lead out). Cache folders are created private (``0700``) and refused when
another user owns them or others may write to them (:func:`check_private_dir`), because a
folder someone else can write to is a folder someone else can put code in.

Hashing a cache entry's parameters on every start is most of what verification costs (a
750 MB ``params.safetensors``), so a :class:`StampStore` in a private cache folder remembers
each file it has hashed by ``(device, inode, size, mtime_ns, ctime_ns)``: a file whose status
still matches is not hashed again. Any write, truncation, rename or ``utime`` on the file
changes its ``ctime``, which unprivileged users cannot set; stamps are kept only in a folder
that passes :func:`check_private_dir` and are never used with ``FXCOMPILER_TRUST_CACHE_DIR=1``
(see docs/security.md for the trust model).

Requires: nothing beyond the standard library. Ensures: the helpers raise
:class:`IntegrityError` (a ``ValueError``) naming the file and the reason.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from pathlib import Path
from typing import Any

CHECKSUMS = "checksums.json"  # a cache entry's record: {"files": {rel: {"size", "sha256"}}}


class IntegrityError(ValueError):
    """A file or path that fails verification (the message names it and why)."""


class UntrustedCacheError(PermissionError):
    """A cache folder owned by another user or writable by group/others."""


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


_STAMP_MIN_AGE_NS = 2_000_000_000  # file timestamps are coarse (a jiffy): only stamp files changed >= 2 s ago


class StampStore:
    """sha256 digests of files remembered by their status, in a private folder (one JSON per file)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def _record_path(self, path: Path) -> Path:
        return self.directory / hashlib.sha256(os.fsencode(os.path.abspath(path))).hexdigest()[:40]

    @staticmethod
    def _status(st: os.stat_result) -> list[int]:
        return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]

    def sha256(self, path: str | os.PathLike) -> str:
        """The sha256 of ``path``: remembered if its status is unchanged since it was hashed, else hashed
        (and remembered when the file is old enough that a later change must move its ``ctime``)."""
        import time

        path = Path(path)
        st = os.stat(path, follow_symlinks=False)
        record = self._record_path(path)
        try:
            data = json.loads(record.read_text())
            if data.get("path") == os.path.abspath(path) and data.get("status") == self._status(st) \
                    and isinstance(data.get("sha256"), str):
                return data["sha256"]
        except (OSError, ValueError, AttributeError):
            pass
        digest = sha256_file(path)
        after = os.stat(path, follow_symlinks=False)
        if self._status(after) == self._status(st) and time.time_ns() - st.st_ctime_ns >= _STAMP_MIN_AGE_NS:
            tmp = record.with_name(f".tmp-{os.getpid()}-{record.name}")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump({"path": os.path.abspath(path), "status": self._status(st), "sha256": digest}, f)
                os.replace(tmp, record)
            except OSError:
                tmp.unlink(missing_ok=True)
        return digest


    def settle(self, paths: list[Path], min_bytes: int = 64 << 20) -> "threading.Thread | None":
        """Stamp freshly written files of at least ``min_bytes`` (smaller ones cost the next start little to
        hash) in a daemon thread, each once it is old enough (``_STAMP_MIN_AGE_NS``
        after its ctime), by hashing it then: the process that wrote a cache entry records the stamps, so the
        first start that reads the entry does not hash it (757 MB of parameters: ~0.85 s). A file changed
        meanwhile is stamped with what it holds then, as any later verification would. A process that ends
        first waits for it at exit, at most ``_SETTLE_EXIT_WAIT_S`` in all (a build is tens of seconds; the
        wait spares the next start its hashing); past that the next reader stamps them."""
        import atexit
        import threading
        import time

        paths = [p for p in paths if os.path.isfile(p) and os.path.getsize(p) >= min_bytes]
        if not paths:
            return None

        def run() -> None:
            for path in paths:
                try:
                    wait = _STAMP_MIN_AGE_NS - (time.time_ns() - os.stat(path, follow_symlinks=False).st_ctime_ns)
                    if wait > 0:
                        time.sleep(wait / 1e9 + 0.01)
                    self.sha256(path)
                except OSError:
                    continue

        thread = threading.Thread(target=run, name="fxcompiler-stamps", daemon=True)
        thread.start()
        if not _settling:
            atexit.register(_finish_settling)
        _settling.append(thread)
        return thread


_SETTLE_EXIT_WAIT_S = 5.0
_settling: list = []  # StampStore.settle threads of this process


def _finish_settling() -> None:
    """At exit: give the stamping threads up to ``_SETTLE_EXIT_WAIT_S`` seconds in all to finish."""
    import time

    deadline = time.monotonic() + _SETTLE_EXIT_WAIT_S
    for thread in _settling:
        thread.join(max(0.0, deadline - time.monotonic()))


def stamp_store(cache_dir: str | os.PathLike | None) -> StampStore | None:
    """The :class:`StampStore` of ``cache_dir`` (``cache_dir/verified``), or None where stamps must not
    be trusted: no cache folder, ``FXCOMPILER_TRUST_CACHE_DIR=1`` (a folder others may write to),
    ``FXCOMPILER_VERIFY_STAMPS=0``, or a folder that is not private to this user."""
    if cache_dir is None or os.environ.get("FXCOMPILER_TRUST_CACHE_DIR") == "1" \
            or os.environ.get("FXCOMPILER_VERIFY_STAMPS", "1") == "0":
        return None
    root = Path(cache_dir)
    try:
        if _mode_problem(root, root.stat()) is not None:
            return None
        return StampStore(check_private_dir(root / "verified", what="verified-stamp folder"))
    except OSError:
        return None


def confined(root: str | os.PathLike, rel: Any, *, what: str = "path") -> Path:
    """``root / rel`` resolved, which must stay inside ``root``: ``rel`` must be a relative
    string without ``..`` parts, and no symlink on the way may lead outside ``root``."""
    root = Path(root)
    if not isinstance(rel, str) or not rel:
        raise IntegrityError(f"{root}: {what} must be a non-empty relative path string, got {rel!r}")
    p = Path(rel)
    if p.is_absolute() or rel.startswith(("/", "\\")) or (len(rel) > 1 and rel[1] == ":"):
        raise IntegrityError(f"{root}: {what} {rel!r} is absolute; only paths inside the folder are allowed")
    if any(part == ".." for part in p.parts) or "\\" in rel or "\x00" in rel:
        raise IntegrityError(f"{root}: {what} {rel!r} leaves the folder ('..' or a backslash)")
    real_root = root.resolve()
    full = (root / p).resolve()
    if full != real_root and real_root not in full.parents:
        raise IntegrityError(f"{root}: {what} {rel!r} resolves to {full}, outside the folder (a symlink out)")
    return full


def file_records(root: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "sha256"}}`` of every regular file under ``root`` (the record
    file itself excluded)."""
    root = Path(root)
    out = {}
    for f in sorted(root.rglob("*")):
        if f.is_file() and not f.is_symlink() and f.name != CHECKSUMS:
            out[f.relative_to(root).as_posix()] = {"size": f.stat().st_size, "sha256": sha256_file(f)}
    return out


def write_checksums(root: str | os.PathLike) -> None:
    """Record the size and sha256 of every file of the entry ``root`` in ``root/checksums.json``."""
    (Path(root) / CHECKSUMS).write_text(json.dumps({"files": file_records(root)}, indent=1, sort_keys=True))


def verify_records(root: str | os.PathLike, files: Any, *, manifest: str = CHECKSUMS,
                   exhaustive: bool = True, exclude: tuple[str, ...] = (), stamps: StampStore | None = None) -> None:
    """Every file of ``files`` (``{rel: {"size", "sha256"}}``) exists inside ``root`` with that size
    and sha256; with ``exhaustive`` no other regular file or any symlink exists under ``root``.
    ``stamps``: digests of unchanged files are taken from there (:class:`StampStore`)."""
    root = Path(root)
    if not isinstance(files, dict) or not files:
        raise IntegrityError(f"{root / manifest}: has no file list")
    for rel, info in files.items():
        f = confined(root, rel, what=f"file listed in {manifest}")
        if (root / rel).is_symlink():
            raise IntegrityError(f"{root / rel}: is a symlink; entries hold regular files only")
        if not f.is_file():
            raise IntegrityError(f"{f}: missing (listed in {manifest})")
        if not isinstance(info, dict) or not isinstance(info.get("size"), int) or not isinstance(info.get("sha256"), str):
            raise IntegrityError(f"{root / manifest}: malformed record for {rel!r}")
        size = f.stat().st_size
        if size != info["size"]:
            raise IntegrityError(f"{f}: size {size} bytes, expected {info['size']} (truncated or replaced)")
        if (stamps.sha256(f) if stamps is not None else sha256_file(f)) != info["sha256"]:
            raise IntegrityError(f"{f}: sha256 differs from {manifest} (the file was modified)")
    if exhaustive:
        for f in root.rglob("*"):
            rel = f.relative_to(root).as_posix()
            if rel.startswith(exclude):
                continue
            if f.is_symlink():
                raise IntegrityError(f"{f}: is a symlink; entries hold regular files only")
            if f.is_file() and rel != manifest and rel not in files:
                raise IntegrityError(f"{f}: not listed in {manifest} (planted or left behind)")


def verify_checksums(root: str | os.PathLike, *, exclude: tuple[str, ...] = (),
                     stamps: StampStore | None = None) -> None:
    """Check the entry ``root`` against its ``checksums.json`` (see :func:`verify_records`)."""
    root = Path(root)
    rec = root / CHECKSUMS
    if not rec.is_file():
        raise IntegrityError(f"{rec}: missing (an entry without checksums is never trusted)")
    try:
        files = json.loads(rec.read_text()).get("files")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise IntegrityError(f"{rec}: not valid JSON ({exc})") from None
    verify_records(root, files, exclude=exclude, stamps=stamps)


def _mode_problem(path: Path, st: os.stat_result) -> str | None:
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def check_private_dir(path: str | os.PathLike, *, create: bool = True, what: str = "cache_dir") -> Path:
    """Create ``path`` (mode ``0700``) or check an existing one: owned by this user and not
    writable by group or others (else :class:`UntrustedCacheError`: code loaded from such a folder
    could have been put there by someone else). ``FXCOMPILER_TRUST_CACHE_DIR=1`` skips the check
    (a shared cache on purpose)."""
    p = Path(path)
    if create and not p.exists():
        p.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            os.chmod(p, 0o700)
        except OSError:
            pass
    if os.environ.get("FXCOMPILER_TRUST_CACHE_DIR") == "1" or not p.exists():
        return p
    st = p.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedCacheError(f"{what} {os.fspath(p)!r} is not a directory")
    problem = _mode_problem(p, st)
    if problem is not None:
        raise UntrustedCacheError(
            f"{what} {os.fspath(p)!r} {problem}: another user could place code there that this process would "
            f"load (kernels, graphs). Use a private folder (chmod 700, owned by you), or set "
            f"FXCOMPILER_TRUST_CACHE_DIR=1 to share it on purpose")
    return p


def load_allowlist(value: str | os.PathLike | None = None) -> set[str] | None:
    """The trusted artifact manifest hashes: ``value`` (or ``$FXCOMPILER_TRUSTED_ARTIFACTS``) is a
    file with one sha256 hex digest per line (``#`` comments); None when not configured."""
    src = value if value is not None else os.environ.get("FXCOMPILER_TRUSTED_ARTIFACTS")
    if not src:
        return None
    out = set()
    for line in Path(src).read_text().splitlines():
        line = line.split("#", 1)[0].strip().lower()
        if line:
            if len(line) != 64 or any(c not in "0123456789abcdef" for c in line):
                raise IntegrityError(f"{src}: {line!r} is not a sha256 hex digest")
            out.add(line)
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(root: str | os.PathLike, prefix: str, *, legacy_age_s: float = 3600.0) -> list[Path]:
    """Remove ``root/<prefix><pid>-...`` temporary folders whose writer process is gone (and
    ones without a pid older than ``legacy_age_s``); returns what was removed."""
    import shutil
    import time

    removed = []
    root = Path(root)
    if not root.is_dir():
        return removed
    for d in root.glob(f"{prefix}*"):
        rest = d.name[len(prefix):]
        pid_text = rest.split("-", 1)[0]
        if pid_text.isdigit() and len(pid_text) <= 7:
            stale = int(pid_text) != os.getpid() and not _pid_alive(int(pid_text))
        else:
            try:
                stale = time.time() - d.stat().st_mtime > legacy_age_s
            except OSError:
                continue
        if stale:
            shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)
            removed.append(d)
    return removed


_process_dirs: dict[tuple[str, int], Path] = {}  # (prefix, pid) -> that process's folder
_process_dirs_lock = threading.Lock()


def _remove_process_dir(pid: int, root: Path) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the exit handler
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def process_temp_dir(prefix: str) -> Path:
    """This process's temporary folder ``<tmp>/<prefix><pid>-*`` for what a build writes without a cache dir
    (GGUF and pre-quantised conversions, edf packages: hundreds of MB each): made once per process and prefix,
    removed at exit; the folders of the same prefix whose process died without removing theirs are removed
    when it is made (:func:`remove_stale_temps`)."""
    import atexit
    import tempfile

    pid = os.getpid()
    with _process_dirs_lock:
        root = _process_dirs.get((prefix, pid))
        if root is None or not root.is_dir():
            remove_stale_temps(tempfile.gettempdir(), prefix)
            root = Path(tempfile.mkdtemp(prefix=f"{prefix}{pid}-"))
            _process_dirs[(prefix, pid)] = root
            atexit.register(_remove_process_dir, pid, root)
        return root
