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


def test_encoder_rows_claim_what_the_encoder_tests_check():
    """The encoder table's parity column is the list of checks tests/test_encoder_tasks.py runs per case
    (parametrised over fxcompiler.encoder_zoo); its measured columns are checked there, with its builds."""
    from fxcompiler.encoder_zoo import ENCODER_ZOO, parity_text
    from fxcompiler.support import ENCODER_BEGIN, ENCODER_END

    rows = [line.split(" | ") for line in extract(DOC.read_text(), ENCODER_BEGIN, ENCODER_END).splitlines()[3:-1]]
    assert [r[0].removeprefix("| ") for r in rows] == list(ENCODER_ZOO)
    assert [r[4] for r in rows] == [parity_text(c) for c in ENCODER_ZOO.values()]
