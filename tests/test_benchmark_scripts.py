"""The benchmark scripts run as ``python benchmarks/<name>.py``, which puts ``benchmarks/`` first on
``sys.path``: a script named like a package that torch or transformers probes for (``kernels`` was one)
shadows it, and importing a model config then fails inside transformers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_no_benchmark_module_shadows_an_installed_package(tmp_path):
    """Asked in a fresh interpreter outside the checkout: this process may hold benchmark modules that other
    tests imported by name (test_parallel's ``allreduce``), which ``find_spec`` would report from sys.modules."""
    scripts = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    assert scripts, "no benchmark scripts found"
    code = ("import importlib.util, json, sys; names = json.loads(sys.argv[1]);"
            "print(json.dumps([n for n in names if importlib.util.find_spec(n) is not None]))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(scripts)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-2000:]
    shadowing = json.loads(done.stdout)
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
