"""Helpers of the artifact-tampering tests: read / rewrite an artifact's manifest, a planted payload."""
from __future__ import annotations

import json
from pathlib import Path


def read_manifest(root: Path) -> dict:
    return json.loads((root / "artifact.json").read_text())


def write_manifest(root: Path, m: dict) -> None:
    (root / "artifact.json").write_text(json.dumps(m))


def payload(sentinel: Path) -> str:
    """Python source that creates ``sentinel`` if it ever runs."""
    return f"open({str(sentinel)!r}, 'w').write('pwned')\n"
