"""docs/writing-a-pass.md and docs/architecture.md say what the code does (issue 22, point 6):
the default pipeline as listed, the pass contract's names, the placement rules, the testing
helpers, the sections the modules cite, and the pattern-matcher snippet, which runs as written."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fxcompiler import testing
from fxcompiler.pass_manager import (
    DEFAULT_PASSES,
    PASSES_SPEC_KEYS,
    PLACEMENT_KEYS,
    RESERVED_INFO_KEYS,
    get_pass,
)

ROOT = Path(__file__).resolve().parent.parent
GUIDE = (ROOT / "docs" / "writing-a-pass.md").read_text()
ARCH = (ROOT / "docs" / "architecture.md").read_text()


def section(text: str, heading: str) -> str:
    """The body of the markdown section ``heading`` (up to the next heading of any level)."""
    m = re.search(rf"^#+ {re.escape(heading)}\n(.*?)(?=^#+ |\Z)", text, re.S | re.M)
    assert m, f"no section {heading!r}"
    return m.group(1)


def pattern_matcher_snippet() -> str:
    """The first Python block of "The pattern matcher" in docs/writing-a-pass.md."""
    return re.search(r"```python\n(.*?)```", section(GUIDE, "The pattern matcher"), re.S).group(1)


def code_lines(source: str) -> int:
    """Lines of code: not blank, not a comment, not in a docstring."""
    source = re.sub(r'^\s*[rR]?"""(.*?)"""', "", source, flags=re.S | re.M)
    return sum(1 for line in source.splitlines() if line.strip() and not line.strip().startswith("#"))


def _arrows(text: str) -> list[str]:
    return [p.strip(" `│\n") for p in text.replace("\n", " ").split("→")]


def test_default_pipeline_is_listed_as_it_is():
    guide = re.search(r"The default pipeline is `([^`]*)`", GUIDE, re.S).group(1)
    assert _arrows(guide) == list(DEFAULT_PASSES)
    diagram = re.search(r"PassManager\(build_pass_list.*?\n(.*?)\(the modules in passes/", ARCH, re.S).group(1)
    assert [re.sub(r"\s+", " ", p).strip(" │") for p in diagram.split("→")] == list(DEFAULT_PASSES)
    rows = {}
    for line in section(ARCH, "The pass library").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for name in re.findall(r"`([a-z_0-9]+)`", cells[0]) if len(cells) == 4 else ():
            rows[name] = cells[3]
    for name in DEFAULT_PASSES:
        assert name in rows and not rows[name].startswith("no"), name
    assert rows["lower_cpu_kernels"].startswith("yes")  # it is in the default list (the doc said it was not)
    assert rows["canonicalize_indices"].startswith("no") and get_pass("canonicalize_indices").name == "canonicalize_indices"
    assert "canonicalize_indices" in section(GUIDE, "What a pass may use")


def test_modules_cite_sections_that_exist():
    cited = 0
    for module in ("pass_manager", "pattern_matcher", "instruments", "numerics", "repro", "testing"):
        text = (ROOT / "fxcompiler" / f"{module}.py").read_text()
        for doc, heading in re.findall(r"``(docs/[\w.-]+\.md)``(?:, \"([^\"]+)\")?", text):
            assert (ROOT / doc).is_file(), (module, doc)
            if heading:
                section((ROOT / doc).read_text(), heading)
            cited += 1
    assert cited >= 2


def test_contract_placements_and_helpers_are_documented():
    contract = section(GUIDE, "The contract (enforced)")
    for key in RESERVED_INFO_KEYS:
        assert f"`{key}`" in contract, key
    assert "PassRequirements" in contract and "must_fire" in contract and "PassDidNotFire" in contract
    placements = section(GUIDE, "Plugging it in: placements")
    for key in (*PLACEMENT_KEYS, *PASSES_SPEC_KEYS, "dce#2", "--passes-json", "passes_override", "module:attribute"):
        assert key in placements, key
    assert "unknown" in placements.lower() and "error" in placements.lower()
    uses = section(GUIDE, "What a pass may use")
    for name in ("get_pass", "refresh_meta_val", "propagate_fake_shapes", "fxcompiler.pass_manager"):
        assert name in uses or name in GUIDE.split("## What a pass may use")[0], name
    tests = section(GUIDE, "Testing it")
    assert "raw export" in tests and "before `decompose`" in tests
    assert "default-up-to:" in tests and "returns the pass's `info`" in tests
    debugging = section(GUIDE, "Verification and numeric checks") + section(GUIDE, "Seeing the graphs")
    for word in ("--bisect", "FXCOMPILER_BISECT", "FiniteCheckInstrument", ".code.diff", "supertasks/", "replay.py",
                 "repro-NN-<pass>"):
        assert word in debugging, word


def test_pattern_matcher_snippet_runs_as_written_and_fires():
    """The docs' example, executed verbatim, fuses every RMSNorm of a tiny fp32 llama and preserves it."""
    snippet = pattern_matcher_snippet()
    assert code_lines(snippet) <= 30
    scope: dict = {}
    exec(compile(snippet, "docs/writing-a-pass.md", "exec"), scope)
    cfg = testing.TinyConfig("llama", layers=2, hidden=32, heads=4, kv_heads=2, vocab=64, intermediate=48)
    program = testing.capture_tiny_model(cfg, dtype=torch.float32)
    inputs = testing.example_inputs(program, testing.TestBucket(2, 3, 5, 4))
    info = testing.assert_pass_preserves_semantics(scope["my_fusion"], program, inputs, rtol=1e-4, atol=1e-4,
                                                   passes_before="default-up-to:fuse_rms_norm")
    assert info == {"matched": 2 * cfg.layers + 1}
    # the built-in fusion finds nothing left to fuse afterwards
    assert testing.assert_pass_preserves_semantics(get_pass("fuse_rms_norm"), program, inputs,
                                                   passes_before=[*testing.default_passes_up_to("fuse_rms_norm"),
                                                                  scope["my_fusion"]])["fused"] == 0


@pytest.mark.parametrize("path", ["examples/fuse_swiglu.py"])
def test_pattern_matcher_example_is_short(path):
    assert code_lines((ROOT / path).read_text()) <= 30
