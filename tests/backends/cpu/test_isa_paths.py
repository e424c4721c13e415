"""Every kernel path this CPU can run, tested on this CPU: the linear kernels' property tests
(``test_kernels.py``, ``test_linear_bf16dot.py``, ``test_epilogue_kernels.py``) and their code checks
(``test_kernel_codegen.py``) are run again in a subprocess per lower path, forced with the ISA overrides:

* ``avx512+amx``      no override (AMX machines)
* ``avx512+bf16dot``  ``FXCOMPILER_CPU_AMX=0`` (AVX-512-BF16 dot products; AMD Zen 4/5 run it natively)
* ``avx512``          ``FXCOMPILER_CPU_AMX=0 FXCOMPILER_CPU_BF16DOT=0`` (AVX-512 FMA only: Skylake-X, Ice Lake)
* ``avx2``            ``FXCOMPILER_CPU_ISA=avx2`` (AVX2 + FMA, CPUs without AVX-512)

The path the suite itself runs in-process (``fxc.isa()`` with the environment as given) is not repeated.
The avx2 run also runs the flash attention kernel's tests (``test_paged_attention.py -k flash``): the
attention module has an AVX-512 and an AVX2 build, no AMX/BF16 variants.
The subprocess asserts the path it was asked for is the one in use (``FXCOMPILER_EXPECT_ISA``, read by
``test_kernels.test_kernels_built``), so an override that silently stopped working fails here.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import backends.cpu as fxc
from backends.cpu import _build

ROOT = Path(__file__).resolve().parents[3]
PATHS = {
    "avx512+amx": {"FXCOMPILER_CPU_ISA": "avx512"},
    "avx512+bf16dot": {"FXCOMPILER_CPU_ISA": "avx512", "FXCOMPILER_CPU_AMX": "0"},
    "avx512": {"FXCOMPILER_CPU_ISA": "avx512", "FXCOMPILER_CPU_AMX": "0", "FXCOMPILER_CPU_BF16DOT": "0"},
    "avx2": {"FXCOMPILER_CPU_ISA": "avx2"},
}
_CLEAR = ("FXCOMPILER_CPU_ISA", "FXCOMPILER_CPU_AMX", "FXCOMPILER_CPU_BF16DOT", "ATEN_CPU_CAPABILITY")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def available_paths(flags: set[str]) -> list[str]:
    """The kernel paths a CPU with these /proc/cpuinfo flags can run, highest first."""
    out = []
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        if {"amx_tile", "amx_bf16"} <= flags:
            out.append("avx512+amx")
        if "avx512_bf16" in flags:
            out.append("avx512+bf16dot")
        out.append("avx512")
    if {"avx2", "fma"} <= flags:
        out.append("avx2")
    return out


def test_available_paths_from_flags():
    zen5 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
    assert available_paths(zen5) == ["avx512+bf16dot", "avx512", "avx2"]
    spr = zen5 | {"amx_tile", "amx_bf16"}
    assert available_paths(spr) == ["avx512+amx", "avx512+bf16dot", "avx512", "avx2"]
    assert available_paths({"avx2", "fma"}) == ["avx2"]
    assert available_paths({"sse4_2"}) == []


def _own_path() -> str | None:
    return fxc.isa() if fxc.kernels_available() else None


@pytest.mark.slow
@pytest.mark.parametrize("path", list(PATHS))
def test_kernel_properties_on_path(path):
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: only the ATen fallback runs here")
    here = available_paths(cpu_flags())
    if path not in here:
        pytest.skip(f"this CPU cannot run {path} (it runs {here})")
    if path == _own_path():
        pytest.skip(f"{path} is the path this process runs: its tests ran in-process")
    if path == "avx512+amx" and not _build.state().get("amx") and _build.state().get("isa") == "avx512":
        pytest.skip("AMX not enabled by the OS / compiler here")
    env = {k: v for k, v in os.environ.items() if k not in _CLEAR}
    env.update(PATHS[path])
    env["FXCOMPILER_EXPECT_ISA"] = path
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    files = ["tests/backends/cpu/test_kernels.py", "tests/backends/cpu/test_linear_bf16dot.py",
             "tests/backends/cpu/test_epilogue_kernels.py", "tests/backends/cpu/test_kernel_codegen.py"]
    select = "not failed_build and not avx2_build and not without_amx"
    runs = [(files, select)]
    if path == "avx2":  # the attention kernels have an AVX-512 and an AVX2 build only: their flash-kernel tests
        runs.append((["tests/backends/cpu/test_paged_attention.py"], "flash or kernel_built"))
    for run_files, run_select in runs:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *run_files,
               "-k", run_select]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
        tail = (r.stdout + r.stderr)[-4000:]
        assert r.returncode == 0, tail
        assert " passed" in r.stdout and " failed" not in r.stdout, tail
        if run_select.startswith("flash"):  # skipped would mean the AVX2 attention module did not build
            assert " skipped" not in r.stdout, tail
