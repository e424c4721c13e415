"""``backends.cpu.prebuild``: the three C++ extensions build concurrently (or not at all when switched off)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from backends.cpu import prebuild

ROOT = Path(__file__).resolve().parents[3]


def test_tasks_cover_the_three_extensions():
    assert set(prebuild.TASKS) == {"fxc_kernels", "fxc_paged_attention", "fxc_graph_program"}


def test_switched_off_starts_nothing(tmp_path):
    code = textwrap.dedent("""
        import threading
        from backends.cpu import prebuild, _build
        assert prebuild.start() == []
        assert not _build.state()["tried"] and not any(t.name.startswith("fxc-prebuild") for t in threading.enumerate())
        print("OK")
    """)
    env = dict(os.environ, FXCOMPILER_PREBUILD="0", FXCOMPILER_CACHE_DIR=str(tmp_path),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_build_all_without_compiler_reports_unavailable(tmp_path):
    """No compiler: every extension reports unavailable (each loader warns once), none raises."""
    code = textwrap.dedent("""
        import warnings
        warnings.simplefilter("ignore")
        from backends.cpu import prebuild
        res = prebuild.build_all()
        assert set(res) == set(prebuild.TASKS) and not any(res.values()), res
        print("OK")
    """)
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), FXCOMPILER_CACHE_DIR=str(tmp_path),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FXCOMPILER_CPU_ISA", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
