"""Just-in-time build and loading of the C++ kernel library (``csrc/``).

The library is compiled on first use with :func:`torch.utils.cpp_extension.load`
into ``$FXCOMPILER_CACHE_DIR/kernels/<name>`` (default
``$XDG_CACHE_HOME/fxcompiler/kernels/<name>``, else ``~/.cache/...``), where ``<name>`` encodes the ISA and a
hash of the sources' contents, the compile flags and the torch version, so a changed
source or a different machine never reuses a stale binary. The sources are built from
a copy inside that folder, so two checkouts of the same code share one build.

ISA selection: ``FXCOMPILER_CPU_ISA`` (``avx512`` | ``avx2`` | ``aten``) forces
one (``FXCOMPILER_CPU_AMX=0`` and ``FXCOMPILER_CPU_BF16DOT=0`` switch off the AMX and the
AVX-512-BF16 paths of an avx512 build, so every path can be run on a machine that has a higher one); otherwise ``torch.backends.cpu.get_cpu_capability()`` decides (it already
honours ``ATEN_CPU_CAPABILITY``).  ``aten`` (or a CPU without AVX2, or a failed
build) means no C++ kernels: the ops then run their ATen fallback, and a single
``warnings.warn`` says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import torch

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("fxc_kernels.cpp",)

_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c", "-DFXC_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DFXC_AVX2"],
}
_COMMON_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]
_AMX_FLAGS = ["-mamx-tile", "-mamx-bf16", "-DFXC_AMX"]  # added to avx512 when the compiler knows them
# The VDPBF16PS kernel is compiled in (its functions only, via a target attribute: the library still loads
# on AVX-512 CPUs without BF16) when the compiler knows -mavx512bf16; used where CPUID says AVX512_BF16.
_BF16DOT_PROBE = ["-mavx512bf16"]
_BF16DOT_FLAGS = ["-DFXC_BF16DOT"]

_lock = threading.RLock()
_state: dict = {"tried": False, "isa": None, "amx": False, "bf16dot": False, "error": None, "path": None}


def detect_isa() -> str:
    """The kernel ISA to use on this machine: 'avx512', 'avx2' or 'aten'."""
    forced = os.environ.get("FXCOMPILER_CPU_ISA", "").strip().lower()
    if forced:
        if forced not in ("avx512", "avx2", "aten"):
            raise ValueError(f"FXCOMPILER_CPU_ISA must be avx512, avx2 or aten, got {forced!r}")
        return forced
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - very old torch
        cap = "DEFAULT"
    cap = cap.upper()
    if cap.startswith("AVX512"):
        return "avx512"
    if cap.startswith("AVX2"):
        return "avx2"
    return "aten"


def cache_root() -> Path:
    """The process-wide cache folder (kernel builds, autotuning results): the one ``LLM`` defaults to,
    ``$FXCOMPILER_CACHE_DIR``, else ``$XDG_CACHE_HOME/fxcompiler``, else ``~/.cache/fxcompiler``."""
    from fxcompiler.cache_limits import default_cache_dir

    return default_cache_dir()


def cache_dir() -> Path:
    """``cache_root()/kernels``, created private (0700) and refused when another user owns it or
    group/others can write to it (fxcompiler.integrity.check_private_dir): libraries are loaded from it."""
    from fxcompiler.integrity import check_private_dir

    check_private_dir(cache_root(), what="kernel cache root ($FXCOMPILER_CACHE_DIR)")
    return check_private_dir(cache_root() / "kernels", what="kernel cache")


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def can_build() -> bool:
    """Whether this machine can build the C++ kernels: a kernel ISA path (not ``aten``) and a C++ compiler.
    Tests skip a kernel only where this is False; a kernel that fails to build where it is True is a failure."""
    return detect_isa() != "aten" and shutil.which(_compiler()) is not None


def _compiler_accepts(flags: list[str]) -> bool:
    try:
        r = subprocess.run([_compiler(), *flags, "-x", "c++", "-E", "-o", os.devnull, os.devnull],
                           capture_output=True, timeout=60)
        return r.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def compile_flags(isa: str) -> list[str]:
    flags = _COMMON_FLAGS + _FLAGS[isa]
    if isa == "avx512" and _compiler_accepts(_AMX_FLAGS[:2]):
        flags = flags + _AMX_FLAGS
    if isa == "avx512" and _compiler_accepts(_BF16DOT_PROBE):
        flags = flags + _BF16DOT_FLAGS
    # extra flags for experiments (e.g. -DFXC_TUNE); part of the cache key like the others
    return flags + os.environ.get("FXCOMPILER_KERNEL_CFLAGS", "").split()


def build_name(isa: str, flags: list[str]) -> str:
    h = hashlib.sha256()
    for src in _SOURCES:
        text = (_CSRC / src).read_bytes()
        h.update(src.encode())
        h.update(text)
        for header in re.findall(rb'^#include "([^"]+)"', text, flags=re.M):  # its own headers: in the key
            h.update((_CSRC / header.decode()).read_bytes())
    h.update(" ".join(flags).encode())
    h.update(torch.__version__.encode())
    return f"fxc_cpu_{isa}_{h.hexdigest()[:12]}"


def source_digest(paths, flags: list[str]) -> str:
    """12 hex digits of the sources' bytes, the flags and the torch version: an extension's cache key."""
    data = b"".join(Path(p).read_bytes() for p in paths) + " ".join(flags).encode() + torch.__version__.encode()
    return hashlib.sha256(data).hexdigest()[:12]


def _write_if_changed(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically unless it already holds exactly those bytes."""
    if path.exists() and path.read_bytes() == data:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _stage_sources(build_dir: Path, sources) -> list[Path]:
    """Copy the sources (and every header beside them) into ``build_dir/src``: the build then names only
    paths inside the cache, so any checkout with the same sources reuses it without rebuilding."""
    src_dir = build_dir / "src"
    src_dir.mkdir(exist_ok=True)
    staged = []
    headers = {h for s in sources for h in Path(s).parent.glob("*.h")}
    for h in sorted(headers):
        _write_if_changed(src_dir / h.name, h.read_bytes())
    for s in sources:
        s = Path(s)
        _write_if_changed(src_dir / s.name, s.read_bytes())
        staged.append(src_dir / s.name)
    return staged


def _library_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """An exclusive ``flock`` on ``build_dir.lock``: released by the kernel when its holder dies, so a
    killed build never blocks the next one. Inside it, a ``lock`` file of torch's own build baton can
    only be a leftover of a killed build and is removed (torch would wait on it forever)."""
    lock_path = build_dir.with_name(build_dir.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            stale.unlink()
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def load_extension(name: str, sources, flags: list[str], **kwargs):
    """Build (once, into ``cache_dir()/name``) and load a C++ extension with ``torch.utils.cpp_extension``;
    ``FXCOMPILER_VERBOSE_BUILD`` shows the compiler output. ``kwargs`` go to ``cpp_extension.load``.

    ``name`` carries a digest of the sources' contents and flags (``source_digest``); the sources are
    built from a copy inside the cache folder, so the entry is relocatable between checkouts. Builders
    serialise on a ``flock`` that dies with its owner. The library's sha256 is recorded after a build
    and checked before every load: a truncated or modified ``.so`` is removed and rebuilt, never loaded.
    A library whose checksum matches and whose recorded build inputs (``<name>.so.inputs``: the staged
    sources and headers, flags, arguments, torch version) equal the current ones is loaded directly,
    without ``cpp_extension`` (its import and ninja's check cost a warm start ~0.25 s); anything else
    goes through ``cpp_extension.load``, which rebuilds what changed."""
    build_dir = cache_dir() / name
    os.environ.setdefault("MAX_JOBS", "2")
    with build_lock(build_dir):  # created under the lock: a cache prune skips entries whose lock is held
        build_dir.mkdir(exist_ok=True)
        staged = _stage_sources(build_dir, sources)
        lib = build_dir / f"{name}.so"
        digest_file = build_dir / f"{name}.so.sha256"
        verified = lib.exists() and digest_file.exists() and digest_file.read_text().strip() == _library_digest(lib)
        inputs_file = build_dir / f"{name}.so.inputs"
        inputs = _inputs_digest(build_dir, flags, kwargs)
        if verified and inputs_file.exists() and inputs_file.read_text().strip() == inputs:
            return _load_built(name, lib, kwargs.get("is_python_module", True))  # no ninja, no setuptools
        from torch.utils import cpp_extension

        if lib.exists() and not verified:
            warnings.warn(f"fxcompiler: kernel library {lib} does not match its recorded checksum (an interrupted "
                          "build or a modified file); rebuilding it", RuntimeWarning, stacklevel=2)
            lib.unlink()
            digest_file.unlink(missing_ok=True)
            (build_dir / ".ninja_log").unlink(missing_ok=True)  # relink (and recompile) everything
            cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)  # torch skips names it built before
        stamp = lib.stat().st_mtime_ns if verified else None
        module = cpp_extension.load(name=name, sources=[str(s) for s in staged], extra_cflags=flags,
                                    build_directory=str(build_dir),
                                    verbose=bool(os.environ.get("FXCOMPILER_VERBOSE_BUILD")), **kwargs)
        if not verified or lib.stat().st_mtime_ns != stamp:  # built now: record what was built
            _write_if_changed(digest_file, _library_digest(lib).encode())
        _write_if_changed(inputs_file, inputs.encode())  # ninja found it up to date with these inputs
    return module


def _inputs_digest(build_dir: Path, flags: list[str], kwargs: dict) -> str:
    """sha256 of what a build of ``build_dir`` depends on: every staged file (sources and the headers beside
    them: ninja's dependencies), the flags, the other ``cpp_extension.load`` arguments and torch's version."""
    h = hashlib.sha256()
    for f in sorted((build_dir / "src").iterdir()):
        if f.is_file():
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(repr((flags, sorted(kwargs.items()), torch.__version__)).encode())
    return h.hexdigest()


def _load_built(name: str, lib: Path, is_python_module: bool):
    """Load a library whose checksum and build inputs were just verified, as ``cpp_extension.load`` would
    after finding it up to date (without importing ``torch.utils.cpp_extension`` and setuptools, ~0.25 s
    of a warm start, or running ninja)."""
    if not is_python_module:
        torch.ops.load_library(str(lib))
        return str(lib)
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, lib)
    if spec is None or spec.loader is None:
        raise ImportError(f"{lib}: cannot load the extension module {name}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_and_load(isa: str) -> str:
    flags = compile_flags(isa)
    name = build_name(isa, flags)
    # Loads the shared library into the process (registers the CPU kernels).
    load_extension(name, [_CSRC / s for s in _SOURCES], flags, extra_ldflags=["-fopenmp"], is_python_module=False)
    lib_path = cache_dir() / name / f"{name}.so"
    lib = ctypes.CDLL(str(lib_path))
    lib.fxc_kernels_isa.restype = ctypes.c_char_p
    compiled = lib.fxc_kernels_isa().decode()
    if compiled != isa:  # pragma: no cover - would be a build-system bug
        raise RuntimeError(f"library reports ISA {compiled!r}, expected {isa!r}")
    _state["amx"] = bool(lib.fxc_kernels_amx())
    _state["bf16dot"] = bool(lib.fxc_kernels_bf16dot())
    _state["lib"] = lib
    return str(lib_path)


def ensure_loaded() -> bool:
    """Build (once per process) and load the kernels. True when the C++ kernels are active."""
    if _state["tried"]:
        return _state["isa"] is not None
    with _lock:
        if _state["tried"]:
            return _state["isa"] is not None
        isa = detect_isa()
        pf = os.environ.get("FXCOMPILER_CPU_PREFETCH")
        if pf is not None and pf not in ("0", "1", "t0", "nta"):
            raise ValueError(f"FXCOMPILER_CPU_PREFETCH must be 0, 1, t0 or nta, got {pf!r}")
        try:
            if isa == "aten":
                raise RuntimeError("no AVX2/AVX-512 on this CPU (or FXCOMPILER_CPU_ISA=aten)")
            _state["path"] = _build_and_load(isa)
            _state["isa"] = isa
        except Exception as e:  # compiler missing, build error, load error
            _state["error"] = f"{type(e).__name__}: {e}"
            msg = str(e).strip().splitlines()
            short = msg[0] if msg else type(e).__name__
            if isa == "aten":
                # A deliberate choice, not a failure: only warn when it was not forced.
                if os.environ.get("FXCOMPILER_CPU_ISA", "").strip().lower() != "aten":
                    warnings.warn(f"fxcompiler CPU kernels unavailable ({short}); using the ATen fallback",
                                  RuntimeWarning, stacklevel=3)
            else:
                warnings.warn(f"fxcompiler CPU kernels failed to build/load for {isa} ({type(e).__name__}: "
                              f"{short[:300]}); using the ATen fallback", RuntimeWarning, stacklevel=3)
        finally:
            _state["tried"] = True
        return _state["isa"] is not None


def state() -> dict:
    return dict(_state)


def isa_suffix(st: dict | None = None) -> str:
    """'+amx' / '+bf16dot' (AVX-512-BF16 dot products without AMX) / '' for the loaded kernels."""
    st = _state if st is None else st
    return "+amx" if st.get("amx") else ("+bf16dot" if st.get("bf16dot") else "")


def evict(t: torch.Tensor) -> bool:
    """Flush ``t``'s bytes from every cache level (clflush), so that the next read of it comes from DRAM (the
    autotuner's cold calls). False, doing nothing, without the kernel library."""
    if not ensure_loaded():
        return False
    lib = _state["lib"]
    if getattr(lib.fxc_evict, "argtypes", None) is None:
        lib.fxc_evict.argtypes = [ctypes.c_void_p, ctypes.c_long]
        lib.fxc_evict.restype = None
    lib.fxc_evict(ctypes.c_void_p(t.data_ptr()), ctypes.c_long(t.numel() * t.element_size()))
    return True


def set_bf16dot(on: bool) -> bool:
    """Switch the VDPBF16PS path on/off in this process (benchmarks, tests); returns whether it is now in use.
    Off or unavailable: bf16 weights with bf16 activations take the FMA path (AMX, where in use, is unaffected)."""
    if not ensure_loaded():
        return False
    _state["bf16dot"] = bool(_state["lib"].fxc_set_bf16dot(int(bool(on))))
    return _state["bf16dot"]


PREFETCH_KINDS = ("fp32", "bf16", "int8")
PREFETCH_HINTS = {-1: "none", 0: "t0", 1: "t1", 2: "t2", 3: "nta"}


def prefetch_hints() -> dict[str, str]:
    """The decode kernels' software prefetch hint per weight kind (``{"fp32": "nta", "bf16": "none", "int8":
    "nta"}`` on AMD Zen 5 and later, ``"none"`` for every kind on older AMD CPUs, ``"t0"`` elsewhere;
    ``FXCOMPILER_CPU_PREFETCH=0|1|t0|nta`` sets one for every kind). Empty without kernels."""
    if not ensure_loaded():
        return {}
    return {k: PREFETCH_HINTS.get(_state["lib"].fxc_prefetch_hint(i), "none") for i, k in enumerate(PREFETCH_KINDS)}


def set_prefetch_hints(**hints: str) -> dict[str, str]:
    """Change the prefetch hint of some weight kinds in this process (benchmarks, tests; results are the same
    bits with any hint): ``set_prefetch_hints(fp32="t0", int8="none")``. Returns the hints before the change."""
    before = prefetch_hints()
    if not before:
        return before
    codes = {v: k for k, v in PREFETCH_HINTS.items()}
    for kind, hint in hints.items():
        if kind not in PREFETCH_KINDS:
            raise ValueError(f"set_prefetch_hints: unknown weight kind {kind!r}, expected one of {PREFETCH_KINDS}")
        if hint not in codes:
            raise ValueError(f"set_prefetch_hints: {kind}={hint!r}, expected one of {sorted(codes)}")
    merged = {**before, **hints}
    _state["lib"].fxc_set_prefetch_hints(*(codes[merged[k]] for k in PREFETCH_KINDS))
    return before


def set_panel_prefetch(on: bool) -> bool:
    """Switch the fp32 multi-row-block path's L2 prefetch of the next weight panel on/off in this process
    (benchmarks, tests; results are the same bits either way); returns the new state.
    ``FXCOMPILER_CPU_PANEL_PREFETCH=0`` switches it off for a whole process."""
    if not ensure_loaded():
        return False
    return bool(_state["lib"].fxc_set_panel_prefetch(int(bool(on))))


def load_op_library(prefix: str, source, extra_flags=()) -> str:
    """Build (once per content) and load a source that only registers ``fxc::`` kernels (no Python module)
    for this CPU's ISA, into its own cache entry ``<prefix>_<isa>_<digest>``; returns the ISA."""
    isa = detect_isa()
    if isa == "aten":
        raise RuntimeError("no AVX2/AVX-512 on this CPU (or FXCOMPILER_CPU_ISA=aten)")
    flags = _COMMON_FLAGS + _FLAGS[isa] + list(extra_flags)
    local = re.findall(r'^#include "([^"]+)"', Path(source).read_text(), flags=re.M)  # its own headers: in the key
    name = f"{prefix}_{isa}_{source_digest([source, *(Path(source).parent / h for h in local)], flags)}"
    load_extension(name, [source], flags, extra_ldflags=["-fopenmp"], is_python_module=False)
    return isa


def load_once(state: dict, lock, load, unavailable: str) -> object | None:
    """``state["module"]``, calling ``load()`` the first time in this process (under ``lock``). A failure
    (compiler missing, build or load error) is kept in ``state["error"]``, warned about once with
    ``unavailable`` (what runs instead), and gives None from then on."""
    if state["tried"]:
        return state["module"]
    with lock:
        if not state["tried"]:
            try:
                state["module"] = load()
            except Exception as exc:
                state["error"] = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"{unavailable} ({str(exc).splitlines()[0][:200]})", RuntimeWarning, stacklevel=3)
            finally:
                state["tried"] = True
    return state["module"]
