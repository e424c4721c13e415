"""``fxcompiler/models/loader.py``: where a GGUF's dequantised copy goes when there is no cache dir (one folder per
process, converted once there, removed at exit; a dead process's folder removed by the next one)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A conversion stand-in (the real one runs transformers' GGUF loader for ~10 s and writes ~0.5 GB): it writes what a
# finished conversion leaves and counts its calls.
_FAKE = textwrap.dedent("""
    import sys
    from pathlib import Path
    from fxcompiler.models import loader

    calls = []
    def fake_convert(gguf, root, target):
        calls.append(target)
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / ".complete").write_text("")
    loader._convert_into = fake_convert
    gguf = Path(sys.argv[1])
    first = loader.convert_gguf(gguf, "some/model", None)
    again = loader.convert_gguf(gguf, "some/model", None)
    assert first == again and len(calls) == 1, (first, again, calls)
    assert first.parent == loader.temp_conversion_root() and first.parent.name.startswith(f"fxcompiler-gguf-{__import__('os').getpid()}-")
    print(first)
""")


def _run(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", _FAKE, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_conversion_without_a_cache_dir_is_made_once_and_removed_at_exit(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF not really")
    r = _run(tmp_path, str(gguf))
    assert r.returncode == 0, r.stderr[-2000:]
    converted = Path(r.stdout.strip().splitlines()[-1])
    assert converted.is_relative_to(tmp_path) and not converted.exists() and not converted.parent.exists()
    assert not list(tmp_path.glob("fxcompiler-gguf-*"))


def test_a_dead_process_conversion_folder_goes_when_the_next_one_is_made(tmp_path, monkeypatch):
    from fxcompiler import integrity
    from fxcompiler.models import loader

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"fxcompiler-gguf-{dead.pid}-abc"
    (stale / "model").mkdir(parents=True)
    live = tmp_path / f"fxcompiler-gguf-{os.getppid()}-def"  # a process that is still running: kept
    live.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(integrity, "_process_dirs", {})
    root = loader.temp_conversion_root()
    try:
        assert not stale.exists() and live.is_dir()
        assert root.parent == tmp_path and root.name.startswith(f"fxcompiler-gguf-{os.getpid()}-")
        assert loader.temp_conversion_root() == root  # once per process
    finally:
        integrity._remove_process_dir(os.getpid(), root)
    assert not root.exists()
