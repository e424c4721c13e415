"""The C++ extension cache (``backends/cpu/_build.load_extension``): keyed by content and relocatable,
so a second checkout reuses the build; a stale build lock or a damaged library never blocks or
crashes a later start."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from backends.cpu import _build

SOURCE = 'extern "C" int fxc_build_cache_probe() { return 42; }\n'


def _checkout(root: Path) -> Path:
    src = root / "csrc"
    src.mkdir(parents=True)
    (src / "probe.cpp").write_text(SOURCE)
    (src / "probe.h").write_text("// a header beside the source is staged too\n")
    return src / "probe.cpp"


def _load(source: Path) -> Path:
    name = f"fxc_probe_{_build.source_digest([source], ['-O0'])}"
    _build.load_extension(name, [source], ["-O0"], is_python_module=False)
    lib = _build.cache_dir() / name / f"{name}.so"
    assert ctypes.CDLL(str(lib)).fxc_build_cache_probe() == 42
    return lib


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FXCOMPILER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_second_checkout_reuses_the_build(tmp_path, cache):
    lib = _load(_checkout(tmp_path / "clone1"))
    built = lib.stat().st_mtime_ns
    log = (lib.parent / ".ninja_log").read_text()
    assert str(tmp_path / "clone1") not in (lib.parent / "build.ninja").read_text()  # no checkout path recorded
    again = _load(_checkout(tmp_path / "clone2"))
    assert again == lib and lib.stat().st_mtime_ns == built  # nothing relinked
    assert (lib.parent / ".ninja_log").read_text() == log  # nothing recompiled
    assert (lib.parent / "src" / "probe.h").exists()


def _load_in_subprocess(source: Path, cache: Path) -> subprocess.CompletedProcess:
    """Load (building if needed) in a fresh process: a library mapped by this one must not be damaged."""
    code = textwrap.dedent(f"""
        import ctypes, warnings
        from pathlib import Path
        from backends.cpu import _build
        warnings.simplefilter('always')
        src = Path({str(source)!r})
        name = 'fxc_probe_' + _build.source_digest([src], ['-O0'])
        _build.load_extension(name, [src], ['-O0'], is_python_module=False)
        print('answer', ctypes.CDLL(str(_build.cache_dir() / name / (name + '.so'))).fxc_build_cache_probe())
    """)
    env = dict(os.environ, FXCOMPILER_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180,
                          cwd=Path(__file__).resolve().parents[3])


def test_truncated_library_is_rebuilt_not_loaded(tmp_path, cache):
    source = _checkout(tmp_path / "clone")
    first = _load_in_subprocess(source, cache)
    assert first.returncode == 0 and "answer 42" in first.stdout, first.stderr[-2000:]
    (lib,) = (cache / "kernels").glob("fxc_probe_*/fxc_probe_*.so")
    data = lib.read_bytes()
    lib.write_bytes(data[: len(data) // 3])
    again = _load_in_subprocess(source, cache)
    assert again.returncode == 0 and "answer 42" in again.stdout, again.stderr[-2000:]
    assert "does not match its recorded checksum" in again.stderr
    assert (lib.parent / f"{lib.name}.sha256").read_text() == _build._library_digest(lib)


def test_stale_torch_build_lock_does_not_hang(tmp_path, cache):
    """A build killed inside torch's file baton leaves ``<build>/lock``; the next start must not wait on it."""
    source = _checkout(tmp_path / "clone")
    name = f"fxc_probe_{_build.source_digest([source], ['-O0'])}"
    (cache / "kernels" / name).mkdir(parents=True)
    (cache / "kernels" / name / "lock").write_text("")
    out = _load_in_subprocess(source, cache)
    assert out.returncode == 0 and "answer 42" in out.stdout, out.stderr[-2000:]
    assert not (cache / "kernels" / name / "lock").exists()


def _load_code(source: Path, symbol: str) -> str:
    return textwrap.dedent(f"""
        import ctypes, sys
        from pathlib import Path
        from backends.cpu import _build
        src = Path({str(source)!r})
        name = 'fxc_probe_' + _build.source_digest([src], ['-O0'])
        _build.load_extension(name, [src], ['-O0'], is_python_module=False)
        print('answer', ctypes.CDLL(str(_build.cache_dir() / name / (name + '.so'))).{symbol}())
        print('cpp_extension imported', 'torch.utils.cpp_extension' in sys.modules)
    """)


def _run(code: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, FXCOMPILER_CACHE_DIR=str(cache))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180,
                          cwd=Path(__file__).resolve().parents[3])


def test_built_library_loads_without_cpp_extension_and_a_changed_header_rebuilds(tmp_path, cache):
    """A verified library with unchanged build inputs loads without torch's cpp_extension (a warm start); a
    header the source includes is one of those inputs: changing it goes through ninja and rebuilds, never
    loads the stale binary (the source's own digest, the library's name, does not cover the header)."""
    src = tmp_path / "clone" / "csrc"
    src.mkdir(parents=True)
    (src / "probe.cpp").write_text('#include "probe.h"\nextern "C" int fxc_header_probe() { return PROBE; }\n')
    (src / "probe.h").write_text("#define PROBE 7\n")
    code = _load_code(src / "probe.cpp", "fxc_header_probe")
    first = _run(code, cache)
    assert "answer 7" in first.stdout and "cpp_extension imported True" in first.stdout, first.stderr[-2000:]
    warm = _run(code, cache)
    assert "answer 7" in warm.stdout and "cpp_extension imported False" in warm.stdout, warm.stderr[-2000:]
    (src / "probe.h").write_text("#define PROBE 8\n")
    changed = _run(code, cache)
    assert "answer 8" in changed.stdout and "cpp_extension imported True" in changed.stdout, changed.stderr[-2000:]
    again = _run(code, cache)
    assert "answer 8" in again.stdout and "cpp_extension imported False" in again.stdout, again.stderr[-2000:]


def test_modified_library_is_not_loaded_by_the_direct_path(tmp_path, cache):
    """The direct load checks the library's recorded sha256 first: a modified ``.so`` with intact build-input
    records is rebuilt through cpp_extension, not loaded."""
    source = _checkout(tmp_path / "clone")
    first = _load_in_subprocess(source, cache)
    assert first.returncode == 0 and "answer 42" in first.stdout, first.stderr[-2000:]
    (lib,) = (cache / "kernels").glob("fxc_probe_*/fxc_probe_*.so")
    assert (lib.parent / f"{lib.name}.inputs").exists()
    data = bytearray(lib.read_bytes())
    data[-1] ^= 0xFF
    lib.write_bytes(bytes(data))
    again = _load_in_subprocess(source, cache)
    assert again.returncode == 0 and "answer 42" in again.stdout, again.stderr[-2000:]
    assert "does not match its recorded checksum" in again.stderr
    assert (lib.parent / f"{lib.name}.sha256").read_text() == _build._library_digest(lib)
