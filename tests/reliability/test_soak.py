"""The short soak (scripts/soak.py): concurrent streams with cancellations and bad requests, LLMs
created and shut down in a loop; greedy outputs as alone, no RSS growth, no thread or block leaks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_short_soak(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), "--streams", "24", "--wave", "8",
                        "--duration", "20", "--rss-tolerance", "0.05", "--workdir", str(tmp_path / "soak")],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       timeout=900)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    assert lines, p.stderr[-3000:]
    result = json.loads(lines[-1])
    assert p.returncode == 0 and not result["errors"], result
    assert result["cycles"] == 3 and result["completed"] > 0 and result["bad_refused"] + result["cancelled"] > 0
