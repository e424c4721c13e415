"""fxcompiler.integrity: confined paths, file records, private cache folders, stale temporaries."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fxcompiler.integrity import (IntegrityError, UntrustedCacheError, check_private_dir, confined,
                                  remove_stale_temps, verify_checksums, write_checksums)


@pytest.mark.parametrize("rel", ["../x", "a/../../x", "/etc/passwd", "", "a\\..\\b", "a\x00b", None, 5])
def test_confined_rejects_paths_that_leave_the_root(tmp_path, rel):
    with pytest.raises(IntegrityError):
        confined(tmp_path, rel)


def test_confined_rejects_a_symlink_out(tmp_path):
    (tmp_path / "out").mkdir()
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to(tmp_path / "out")
    with pytest.raises(IntegrityError, match="outside the folder"):
        confined(root, "link/evil.py")
    assert confined(root, "sub/ok.py") == (root / "sub" / "ok.py").resolve()


def _entry(tmp_path):
    e = tmp_path / "entry"
    (e / "graphs").mkdir(parents=True)
    (e / "graph.py").write_text("def forward(self): pass\n")
    (e / "graphs" / "b.bin").write_bytes(b"\x00" * 100)
    write_checksums(e)
    return e


def test_checksums_accept_an_intact_entry(tmp_path):
    verify_checksums(_entry(tmp_path))


@pytest.mark.parametrize("damage, match", [
    (lambda e: (e / "graph.py").write_text("import os\n" + (e / "graph.py").read_text()), "size|sha256"),
    (lambda e: (e / "graphs" / "b.bin").write_bytes(b"\x01" + b"\x00" * 99), "sha256 differs"),
    (lambda e: (e / "graphs" / "b.bin").write_bytes(b"\x00" * 50), "truncated"),
    (lambda e: (e / "graph.py").unlink(), "missing"),
    (lambda e: (e / "planted.py").write_text("x"), "not listed"),
    (lambda e: (e / "checksums.json").unlink(), "never trusted"),
    (lambda e: (e / "checksums.json").write_text("{"), "not valid JSON"),
])
def test_checksums_detect_each_kind_of_damage(tmp_path, damage, match):
    e = _entry(tmp_path)
    damage(e)
    with pytest.raises(IntegrityError, match=match):
        verify_checksums(e)


def test_checksums_refuse_a_symlinked_file(tmp_path):
    e = _entry(tmp_path)
    target = tmp_path / "elsewhere.py"
    target.write_text((e / "graph.py").read_text())
    (e / "graph.py").unlink()
    (e / "graph.py").symlink_to(target)
    with pytest.raises(IntegrityError, match="symlink"):
        verify_checksums(e)


def test_private_dir_is_created_0700(tmp_path):
    p = check_private_dir(tmp_path / "new" / "cache")
    assert (p.stat().st_mode & 0o777) == 0o700


def test_world_writable_cache_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("FXCOMPILER_TRUST_CACHE_DIR", raising=False)
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(UntrustedCacheError, match="writable by group or others"):
        check_private_dir(d)
    monkeypatch.setenv("FXCOMPILER_TRUST_CACHE_DIR", "1")
    check_private_dir(d)


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="chown to another user needs root")
def test_cache_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("FXCOMPILER_TRUST_CACHE_DIR", raising=False)
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(UntrustedCacheError, match="owned by uid 65534"):
        check_private_dir(d)


def test_llm_refuses_an_untrusted_cache_dir(tmp_path, monkeypatch, llama_dir):
    from fxcompiler import LLM

    monkeypatch.delenv("FXCOMPILER_TRUST_CACHE_DIR", raising=False)
    d = tmp_path / "cache"
    d.mkdir()
    os.chmod(d, 0o775)
    with pytest.raises(UntrustedCacheError, match="cache_dir"):
        LLM(str(llama_dir), cache_dir=d)


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (tmp_path / f".convert-{dead_pid}-abc").mkdir()
    (tmp_path / f".convert-{os.getpid()}-mine").mkdir()
    old = tmp_path / ".convert-legacy"
    old.mkdir()
    os.utime(old, (0, 0))
    removed = {p.name for p in remove_stale_temps(tmp_path, ".convert-")}
    assert removed == {f".convert-{dead_pid}-abc", ".convert-legacy"}
    assert (tmp_path / f".convert-{os.getpid()}-mine").exists()


# -- verified stamps: unchanged files are not hashed again, any change is --------------------------------------------
def _counting_hash(monkeypatch):
    from fxcompiler import integrity

    calls = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p: calls.append(os.fspath(p)) or real(p))
    return calls


def _stamped_entry(tmp_path, monkeypatch):
    from fxcompiler import integrity

    monkeypatch.delenv("FXCOMPILER_TRUST_CACHE_DIR", raising=False)
    monkeypatch.setattr(integrity, "_STAMP_MIN_AGE_NS", 0)  # files of this test are seconds old, not minutes
    cache = check_private_dir(tmp_path / "cache")
    e = _entry(cache)
    stamps = integrity.stamp_store(cache)
    assert stamps is not None and (stamps.directory.stat().st_mode & 0o777) == 0o700
    return e, stamps


def test_stamps_skip_hashing_unchanged_files(tmp_path, monkeypatch):
    e, stamps = _stamped_entry(tmp_path, monkeypatch)
    calls = _counting_hash(monkeypatch)
    verify_checksums(e, stamps=stamps)
    assert len(calls) == 2  # graph.py and graphs/b.bin, hashed once
    verify_checksums(e, stamps=stamps)
    assert len(calls) == 2  # the second verification hashed nothing


@pytest.mark.parametrize("restore_mtime", [False, True])
def test_stamps_never_hide_a_modified_file(tmp_path, monkeypatch, restore_mtime):
    """Same size, mtime put back with utime: the ctime still moves, so the file is hashed and refused."""
    e, stamps = _stamped_entry(tmp_path, monkeypatch)
    verify_checksums(e, stamps=stamps)
    f = e / "graphs" / "b.bin"
    st = f.stat()
    with open(f, "r+b") as fh:
        fh.write(b"\x01")
    if restore_mtime:
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(IntegrityError, match="sha256 differs"):
        verify_checksums(e, stamps=stamps)


def test_a_replaced_file_is_hashed_again(tmp_path, monkeypatch):
    e, stamps = _stamped_entry(tmp_path, monkeypatch)
    verify_checksums(e, stamps=stamps)
    f = e / "graph.py"
    evil = e / "evil.tmp"
    evil.write_text("import os\n#       ")  # same size as the original line
    os.replace(evil, f)
    with pytest.raises(IntegrityError, match="size|sha256"):
        verify_checksums(e, stamps=stamps)


def test_recently_changed_files_are_not_stamped(tmp_path, monkeypatch):
    """File timestamps are coarse: a file changed less than 2 s ago could change again within the same tick."""
    from fxcompiler import integrity

    monkeypatch.delenv("FXCOMPILER_TRUST_CACHE_DIR", raising=False)
    cache = check_private_dir(tmp_path / "cache")
    e = _entry(cache)
    stamps = integrity.stamp_store(cache)
    calls = _counting_hash(monkeypatch)
    verify_checksums(e, stamps=stamps)
    verify_checksums(e, stamps=stamps)
    assert len(calls) == 4
    assert not any(p.is_file() for p in stamps.directory.iterdir())


def test_no_stamps_for_shared_or_untrusted_cache_folders(tmp_path, monkeypatch):
    from fxcompiler.integrity import stamp_store

    monkeypatch.delenv("FXCOMPILER_TRUST_CACHE_DIR", raising=False)
    private = check_private_dir(tmp_path / "private")
    assert stamp_store(private) is not None
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    assert stamp_store(shared) is None
    assert stamp_store(None) is None
    monkeypatch.setenv("FXCOMPILER_TRUST_CACHE_DIR", "1")
    assert stamp_store(private) is None  # a cache shared on purpose: others may write there, always hash
    monkeypatch.delenv("FXCOMPILER_TRUST_CACHE_DIR")
    monkeypatch.setenv("FXCOMPILER_VERIFY_STAMPS", "0")
    assert stamp_store(private) is None


def test_settle_stamps_fresh_files_once_they_are_old_enough(tmp_path, monkeypatch):
    """The writer of an entry stamps its files in the background after the minimum age, so the first reader
    hashes nothing; a file modified afterwards is still hashed and refused."""
    from fxcompiler import integrity

    monkeypatch.delenv("FXCOMPILER_TRUST_CACHE_DIR", raising=False)
    monkeypatch.setattr(integrity, "_STAMP_MIN_AGE_NS", 300_000_000)
    cache = check_private_dir(tmp_path / "cache")
    e = _entry(cache)
    stamps = integrity.stamp_store(cache)
    files = [e / "graph.py", e / "graphs" / "b.bin"]
    thread = stamps.settle(files, min_bytes=0)
    thread.join(30)
    assert not thread.is_alive()
    calls = _counting_hash(monkeypatch)
    verify_checksums(e, stamps=stamps)
    assert calls == []  # stamped by the writer's thread
    with open(files[1], "r+b") as fh:
        fh.write(b"\x01")
    with pytest.raises(IntegrityError, match="sha256 differs"):
        verify_checksums(e, stamps=stamps)
    assert calls == [os.fspath(files[1])]


def test_a_process_that_writes_an_entry_then_exits_leaves_it_stamped(tmp_path):
    """The writer ends right after storing (a one-shot CLI run after a cold build): it waits, boundedly, for
    the stamping thread at exit, so the next start hashes nothing."""
    import subprocess
    import sys
    import textwrap

    cache = check_private_dir(tmp_path / "cache")
    e = _entry(cache)
    code = textwrap.dedent(f"""
        from pathlib import Path
        from fxcompiler import integrity
        stamps = integrity.stamp_store({str(cache)!r})
        stamps.settle([Path({str(e / 'graph.py')!r})], min_bytes=0)
    """)
    env = {k: v for k, v in os.environ.items() if k != "FXCOMPILER_TRUST_CACHE_DIR"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    from fxcompiler.integrity import stamp_store

    assert any(p.is_file() for p in stamp_store(cache).directory.iterdir())  # written by the exited process
    assert stamp_store(cache).settle([e / "graph.py"]) is None  # small files are left to the next reader
