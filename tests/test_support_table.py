"""The support table in docs/models.md is what the code measures now (regenerate: fxcompiler models --write)."""
from __future__ import annotations

from pathlib import Path

import pytest

from fxcompiler.support import extract, measure, support_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"


def test_measure_counts_the_fusions_of_a_llama():
    r = measure("llama")
    assert r.fusions["fuse_qkv_attention"] == 2 and r.fusions["fuse_silu_mul"] == 2
    assert r.kernels.get("qkv_paged_attention") == 2 and "paged_attention" not in r.kernels


@pytest.mark.slow
def test_docs_table_matches_measurements():
    assert extract(DOC.read_text()) == support_table(), \
        "docs/models.md is stale: run `python -m fxcompiler.cli models --write docs/models.md`"
