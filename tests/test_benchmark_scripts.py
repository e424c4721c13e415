"""The benchmark scripts run as ``python benchmarks/<name>.py``, which puts ``benchmarks/`` first on
``sys.path``: a script named like a package that torch or transformers probes for (``kernels`` was one)
shadows it, and importing a model config then fails inside transformers."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_no_benchmark_module_shadows_an_installed_package():
    import importlib.util

    scripts = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    assert scripts, "no benchmark scripts found"
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCHMARKS]
        shadowing = [name for name in scripts if importlib.util.find_spec(name) is not None]
    finally:
        sys.path[:] = saved
    assert not shadowing, f"benchmarks/ modules named like installed packages: {shadowing}"


def test_model_configs_import_with_the_benchmarks_first_on_the_path():
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from transformers import LlamaConfig; LlamaConfig(); print('ok')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(BENCHMARKS)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
