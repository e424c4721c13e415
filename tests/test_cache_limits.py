"""The cache size limit (fxcompiler/cache_limits.py): entries measured, least recently used removed first,
hits refresh recency, what a process uses is never removed by it, removal is rename-then-delete (a reader
sees the whole entry or a miss), the limit setting is parsed strictly, the CLI and the automatic prune
after a store."""
from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fxcompiler import cache_limits
from fxcompiler.cache_limits import (DEFAULT_MAX_BYTES, ENV, cache_usage, enforce_limit, mark_used, max_size,
                                     parse_size, prune)
from fxcompiler.cli import main as cli_main

KIB = 1024
DAY = 86400.0


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    """Each test starts with no entries marked used by this process (the registry is process-wide)."""
    monkeypatch.setattr(cache_limits, "_used", set())
    monkeypatch.delenv(ENV, raising=False)


def _entry(cache: Path, kind: str, name: str, size: int, age_days: float, *, file: bool = False) -> Path:
    """A fabricated entry of ``size`` bytes of data whose last use was ``age_days`` ago."""
    path = cache / kind / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if file:
        path.write_bytes(os.urandom(size))
    else:
        path.mkdir()
        (path / "data.bin").write_bytes(os.urandom(size))
    t = time.time() - age_days * DAY
    os.utime(path, (t, t))
    return path


def _names(entries) -> list[str]:
    return [f"{e.kind}/{e.path.name}" for e in entries]


# --------------------------------------------------------------------------- measuring


def test_usage_counts_entries_and_sidecars_but_not_temporaries_or_locks(tmp_path):
    pkg = _entry(tmp_path, "edf", "a" * 64 + ".pt2", 8 * KIB, 3, file=True)
    pkg.with_name(pkg.name + ".sha256").write_text("0" * 64)
    _entry(tmp_path, "kernels", "fxc_cpu_avx2_x", 16 * KIB, 2)
    (tmp_path / "kernels" / "fxc_cpu_avx2_x.lock").touch()
    (tmp_path / "kernels" / ".tmp-123-half-written").mkdir()
    (tmp_path / "edf" / f"{'b' * 64}.tmp-77.pt2").write_bytes(b"x" * 100)  # edf's own temporary name
    (tmp_path / "models" / ".gguf.lock").parent.mkdir()
    (tmp_path / "models" / ".gguf.lock").touch()
    (tmp_path / "autotune").mkdir()  # not a managed kind
    entries = cache_usage(tmp_path)
    assert _names(entries) == ["edf/" + pkg.name, "kernels/fxc_cpu_avx2_x"]  # oldest first
    edf = entries[0]
    assert edf.sidecars == (pkg.with_name(pkg.name + ".sha256"),)
    allocated = sum(os.lstat(p).st_blocks * 512 for p in (pkg, *edf.sidecars))
    assert edf.bytes == allocated >= 8 * KIB
    kernel = entries[1]
    d = tmp_path / "kernels" / "fxc_cpu_avx2_x"
    assert kernel.bytes == os.lstat(d).st_blocks * 512 + os.lstat(d / "data.bin").st_blocks * 512
    assert abs(kernel.last_used - (time.time() - 2 * DAY)) < 5


def test_symlinks_are_measured_and_removed_as_links_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.bin").write_bytes(os.urandom(64 * KIB))
    cache = tmp_path / "cache"
    (cache / "compiled").mkdir(parents=True)
    (cache / "compiled" / "linked").symlink_to(outside, target_is_directory=True)
    (cache / "captured").symlink_to(outside, target_is_directory=True)  # a kind folder elsewhere: left alone
    entries = cache_usage(cache)
    assert _names(entries) == ["compiled/linked"] and entries[0].bytes < 64 * KIB
    report = prune(cache, 0)
    assert _names(report.removed) == ["compiled/linked"]
    assert not (cache / "compiled" / "linked").is_symlink()
    assert (outside / "precious.bin").stat().st_size == 64 * KIB


# --------------------------------------------------------------------------- pruning


def test_prune_removes_least_recently_used_first_until_under_the_limit(tmp_path):
    for name, kind, age in (("d", "compiled", 1), ("a", "captured", 40), ("c", "models", 5), ("b", "compiled", 20)):
        _entry(tmp_path, kind, name, 100 * KIB, age)
    total = sum(e.bytes for e in cache_usage(tmp_path))
    one = total // 4
    report = prune(tmp_path, total - one - 1)  # just over what three entries need: two go
    assert _names(report.removed) == ["captured/a", "compiled/b"]
    assert report.bytes_before == total and report.bytes_after == total - 2 * one and report.freed == 2 * one
    assert _names(cache_usage(tmp_path)) == ["models/c", "compiled/d"]
    assert not list((tmp_path / "captured").iterdir())  # no temporary left behind
    assert prune(tmp_path, total).removed == []  # under the limit: nothing to do


def test_a_hit_refreshes_recency(tmp_path):
    old = _entry(tmp_path, "compiled", "old", 100 * KIB, 30)
    _entry(tmp_path, "compiled", "newer", 100 * KIB, 10)
    mark_used(old)  # a hit on the oldest entry
    assert abs(os.lstat(old).st_mtime - time.time()) < 5
    cache_limits._used.clear()  # as another process would see it: recency alone decides
    assert _names(cache_usage(tmp_path)) == ["compiled/newer", "compiled/old"]
    assert _names(prune(tmp_path, 150 * KIB).removed) == ["compiled/newer"]


def test_keep_and_entries_used_by_this_process_are_never_removed(tmp_path):
    a = _entry(tmp_path, "compiled", "a", 50 * KIB, 30)
    b = _entry(tmp_path, "captured", "b", 50 * KIB, 20)
    _entry(tmp_path, "edf", "c", 50 * KIB, 10)
    mark_used(b)
    report = prune(tmp_path, 0, keep=(a,))
    assert _names(report.removed) == ["edf/c"]
    assert a.is_dir() and b.is_dir()
    assert report.bytes_after > 0  # protected entries alone exceed the limit: they stay


def test_older_than_removes_only_entries_unused_that_long(tmp_path):
    _entry(tmp_path, "compiled", "stale", 10 * KIB, 40)
    _entry(tmp_path, "compiled", "fresh", 10 * KIB, 1)
    report = prune(tmp_path, None, older_than=30 * DAY)
    assert _names(report.removed) == ["compiled/stale"]
    assert _names(cache_usage(tmp_path)) == ["compiled/fresh"]


def test_dry_run_removes_nothing(tmp_path):
    for i, age in enumerate((3, 2, 1)):
        _entry(tmp_path, "compiled", f"e{i}", 10 * KIB, age)
    before = cache_usage(tmp_path)
    report = prune(tmp_path, 0, dry_run=True)
    assert report.dry_run and _names(report.removed) == ["compiled/e0", "compiled/e1", "compiled/e2"]
    assert report.bytes_after == 0
    assert cache_usage(tmp_path) == before


def test_removal_renames_the_entry_away_before_deleting_it(tmp_path, monkeypatch):
    entry = _entry(tmp_path, "compiled", "e", 10 * KIB, 3)
    pkg = _entry(tmp_path, "edf", "k.pt2", KIB, 3, file=True)
    sidecar = pkg.with_name("k.pt2.sha256")
    sidecar.write_text("x")
    seen = []
    real_rmtree = cache_limits.shutil.rmtree

    def rmtree(path, *a, **k):
        path = Path(path)
        seen.append((path.name, entry.exists(), (path / "data.bin").is_file()))
        real_rmtree(path, *a, **k)

    monkeypatch.setattr(cache_limits.shutil, "rmtree", rmtree)
    assert _names(prune(tmp_path, 0, kinds=("compiled", "edf")).removed) == ["compiled/e", "edf/k.pt2"]
    [(name, original_there, whole)] = seen
    assert not original_there and whole  # gone from its name first, whole under the temporary one
    # the temporary name is one integrity.remove_stale_temps reads as this process's
    assert name.startswith(f".tmp-{os.getpid()}-") and name.split("-")[1] == str(os.getpid())
    assert not pkg.exists() and not sidecar.exists()


def test_a_prune_leftover_of_a_dead_process_is_removed_by_the_next_prune(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / "models" / f".tmp-{dead.stdout.strip()}-prune-x-0123abcd"
    left.mkdir(parents=True)
    (left / "w.bin").write_bytes(b"x")
    prune(tmp_path, None)
    assert not left.exists()


def test_an_entry_whose_builder_holds_its_lock_is_left(tmp_path):
    _entry(tmp_path, "kernels", "fxc_cpu_avx2_abc", 10 * KIB, 5)
    _entry(tmp_path, "models", "m-123", 10 * KIB, 4)
    lock = tmp_path / "kernels" / "fxc_cpu_avx2_abc.lock"
    (tmp_path / "models" / ".m-123.lock").touch()
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as backends/cpu/_build.py's build_lock holds it
        report = prune(tmp_path, 0)
    assert _names(report.busy) == ["kernels/fxc_cpu_avx2_abc"] and _names(report.removed) == ["models/m-123"]
    assert (tmp_path / "kernels" / "fxc_cpu_avx2_abc").is_dir()
    assert lock.exists() and (tmp_path / "models" / ".m-123.lock").exists()  # locks stay (a waiter may hold one)
    assert _names(prune(tmp_path, 0).removed) == ["kernels/fxc_cpu_avx2_abc"]  # released: it goes


def test_entries_mapped_into_this_process_are_marked_used_and_kept(tmp_path):
    import mmap

    lib = _entry(tmp_path, "kernels", "fxc_cpu_avx2_mapped", 16 * KIB, 30)
    _entry(tmp_path, "kernels", "fxc_cpu_avx2_unused", 16 * KIB, 20)
    with open(lib / "data.bin", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ):
        # as a kernel library backends/ loaded: nothing calls mark_used on it
        assert cache_limits.touch_mapped([tmp_path, None]) == [Path(os.path.realpath(lib))]
        assert abs(os.lstat(lib).st_mtime - time.time()) < 5
        cache_limits._used.clear()
        assert _names(prune(tmp_path, 0).removed) == ["kernels/fxc_cpu_avx2_unused"]
    assert _names(prune(tmp_path, 0).removed) == ["kernels/fxc_cpu_avx2_mapped"]  # unmapped: it may go


def test_prune_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="max_bytes"):
        prune(tmp_path, -1)
    with pytest.raises(ValueError, match="older_than"):
        prune(tmp_path, None, older_than=-1)
    with pytest.raises(ValueError, match="unknown cache kind.*'verified'"):
        prune(tmp_path, 0, kinds=("verified",))


# --------------------------------------------------------------------------- the limit setting


@pytest.mark.parametrize("text, expected", [
    ("21474836480", 20 << 30), ("20G", 20 * 10**9), ("20GiB", 20 << 30), ("1.5GiB", 3 << 29), ("500M", 500 * 10**6),
    ("500mb", 500 * 10**6), ("64 KiB", 64 << 10), ("2Ti", 2 << 40), (" 1024B ", 1024), ("0", None), ("none", None),
    ("NONE", None), ("0G", None)])
def test_sizes_parse(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-5G", "20X", "G", "1e9", "1.5.2G", "twenty"])
def test_bad_sizes_say_which_setting_and_what_is_accepted(text):
    with pytest.raises(ValueError) as info:
        parse_size(text)
    msg = str(info.value)
    assert msg.startswith(f"{ENV}={text!r} is not a size")
    assert "500M" in msg and "1.5GiB" in msg and "none" in msg and "powers of 1024" in msg


def test_the_limit_comes_from_the_environment(monkeypatch):
    assert max_size() == DEFAULT_MAX_BYTES == 20 << 30
    monkeypatch.setenv(ENV, "3G")
    assert max_size() == 3 * 10**9
    monkeypatch.setenv(ENV, "none")
    assert max_size() is None
    monkeypatch.setenv(ENV, "lots")
    with pytest.raises(ValueError, match=f"^{ENV}='lots' is not a size"):
        max_size()


# --------------------------------------------------------------------------- the caches


@pytest.fixture(scope="module")
def tiny_program():
    from fxcompiler import testing

    return testing.capture_tiny_model(testing.TinyConfig("llama", 1, 16, 2, 1, 37, 24), dtype=torch.float32)


def test_a_store_prunes_to_the_limit_and_keeps_the_new_entry(tmp_path, monkeypatch, caplog, tiny_program):
    from fxcompiler.capture_cache import CaptureCache

    _entry(tmp_path, "compiled", "oldest", 200 * KIB, 30)
    _entry(tmp_path, "edf", "older.pt2", 200 * KIB, 20, file=True)
    _entry(tmp_path, "models", "recent", 200 * KIB, 1)
    monkeypatch.setenv(ENV, "none")
    CaptureCache(tmp_path).store_captured("k0", tiny_program)
    assert len(cache_usage(tmp_path)) == 4  # no limit: nothing removed
    new_size = next(e.bytes for e in cache_usage(tmp_path) if e.path.name == "k0")
    monkeypatch.setenv(ENV, str(new_size * 2 + 450 * KIB))  # room for the k0/k1 entries and two of the fabricated
    with caplog.at_level(logging.INFO, logger="fxcompiler.cache"):
        CaptureCache(tmp_path).store_captured("k1", tiny_program)
    assert sorted(_names(cache_usage(tmp_path))) == ["captured/k0", "captured/k1", "edf/older.pt2", "models/recent"]
    msg = next(r.getMessage() for r in caplog.records if "cache size limit" in r.getMessage())
    assert "removed 1 least recently used entries" in msg and "compiled/oldest" in msg and "freed" in msg
    monkeypatch.setenv(ENV, "1")  # a limit below what this process just stored and used: those stay
    cache_limits._used.clear()
    CaptureCache(tmp_path).store_captured("k2", tiny_program)
    assert sorted(_names(cache_usage(tmp_path))) == ["captured/k2"]


def test_compile_cache_hits_mark_the_entry_and_a_removed_entry_is_a_miss(tmp_path, monkeypatch, tiny_program):
    import fxcompiler.compile_cache as cc
    from fxcompiler.compile_cache import CompileCache
    from fxcompiler.pass_manager import CompileContext

    p = tiny_program
    cache = CompileCache(tmp_path)
    cache.store("key", p.graph_module, CompileContext(list(p.input_specs), p.params, p.geometry, {}))
    entry = cache.path("key")
    t = time.time() - 10 * DAY
    os.utime(entry, (t, t))
    gm, ctx = cache.load("key")
    assert abs(os.lstat(entry).st_mtime - time.time()) < 5  # the hit refreshed its recency
    assert set(ctx.params) == set(p.params)

    # Another process prunes the entry while this one is loading it: a miss (None), never an exception.
    real = cc.load_program

    def load_while_pruned(directory, **kw):
        r = subprocess.run([sys.executable, "-c", "import sys; from fxcompiler.cache_limits import prune; "
                            "print(len(prune(sys.argv[1], 0).removed))", str(tmp_path)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "1", r.stderr
        return real(directory, **kw)

    monkeypatch.setattr(cc, "load_program", load_while_pruned)
    assert cache.load("key") is None
    assert not entry.exists() and not [p for p in cache.root.iterdir()]
    monkeypatch.setattr(cc, "load_program", real)
    assert cache.load("key") is None  # and the next lookup is a plain miss


# --------------------------------------------------------------------------- the command line


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli_main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_info_prune_and_clear(tmp_path, capsys, monkeypatch):
    _entry(tmp_path, "compiled", "c-old", 300 * KIB, 30)
    _entry(tmp_path, "captured", "x-mid", 300 * KIB, 10)
    _entry(tmp_path, "edf", "e.pt2", 100 * KIB, 2, file=True)
    _entry(tmp_path, "kernels", "k-new", 100 * KIB, 1)
    monkeypatch.setenv(ENV, "5G")
    d = str(tmp_path)
    rc, out, _ = _cli(capsys, "cache", "info", "--cache-dir", d, "--oldest", "2")
    assert rc == 0
    assert "limit: 4.7 GiB (FXCOMPILER_CACHE_MAX_SIZE=5G)" in out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.split()[:1] and
            line.split()[0] in ("compiled", "captured", "edf", "models", "kernels", "model_info", "total")}
    assert rows == {"compiled": "1", "captured": "1", "edf": "1", "models": "0", "kernels": "1", "model_info": "0",
                    "total": "4"}
    oldest = out.split("least recently used (pruned first):\n")[1].splitlines()
    assert [line.split()[-1] for line in oldest] == ["compiled/c-old", "captured/x-mid"]

    rc, out, _ = _cli(capsys, "cache", "prune", "--cache-dir", d, "--max-size", "400KiB", "--dry-run")
    assert rc == 0 and "would remove compiled/c-old" in out and "would remove captured/x-mid" in out
    assert "would be freed" in out and len(cache_usage(tmp_path)) == 4
    rc, out, _ = _cli(capsys, "cache", "prune", "--cache-dir", d, "--older-than", "20")
    assert rc == 0 and "removed compiled/c-old" in out and "x-mid" not in out
    assert len(cache_usage(tmp_path)) == 3
    rc, _, err = _cli(capsys, "cache", "prune", "--cache-dir", d, "--max-size", "4 gigs")
    assert rc == 2 and "--max-size='4 gigs' is not a size" in err

    rc, _, err = _cli(capsys, "cache", "clear", "--cache-dir", d, "--kind", "edf")
    assert rc == 2 and "--yes" in err and len(cache_usage(tmp_path)) == 3
    rc, out, _ = _cli(capsys, "cache", "clear", "--cache-dir", d, "--kind", "edf", "--yes")
    assert rc == 0 and "removed edf/e.pt2" in out
    assert _names(cache_usage(tmp_path)) == ["captured/x-mid", "kernels/k-new"]
    rc, out, _ = _cli(capsys, "cache", "clear", "--cache-dir", d, "--yes")
    assert rc == 0 and cache_usage(tmp_path) == []


def test_cli_cache_runs_as_a_command(tmp_path):
    _entry(tmp_path, "compiled", "c", 10 * KIB, 1)
    r = subprocess.run([sys.executable, "-m", "fxcompiler.cli", "cache", "info", "--cache-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, ENV: "none"})
    assert r.returncode == 0, r.stderr
    assert "limit: none (FXCOMPILER_CACHE_MAX_SIZE=none)" in r.stdout and "compiled/c" in r.stdout
