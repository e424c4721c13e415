"""Dumps of every pass (code, DOT, op histogram diff) and ``fxcompiler compile --dump-dir``."""
from __future__ import annotations

import json

import pytest

from fxcompiler import LLM
from fxcompiler.cli import main
from fxcompiler.pass_manager import DEFAULT_PASSES


def test_dump_dir_writes_one_dump_per_pass(tiny_models, tmp_path):
    LLM(str(tiny_models["llama"]), max_seq_len_to_capture=128, cache_dir=None, skip_engine=True,
        compiler_config_overrides={"dump_dir": str(tmp_path)})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [s["pass"] for s in summary] == list(DEFAULT_PASSES)
    for s in summary:
        stem = f"{s['index']:02d}-{s['pass']}"
        for suffix in (".before.py", ".after.py", ".after.dot", ".diff.txt", ".code.diff"):
            assert (tmp_path / (stem + suffix)).is_file()
    # the textual code diff of a pass: what it removed and what it put in its place
    norm = next(s for s in summary if s["pass"] == "fuse_rms_norm")
    code = (tmp_path / f"{norm['index']:02d}-fuse_rms_norm.code.diff").read_text().splitlines()
    assert code[0].startswith("--- ") and code[1].startswith("+++ ")
    assert any(line.startswith("-") and "aten.rsqrt" in line for line in code)
    assert any(line.startswith("+") and "fxc.rms_norm" in line for line in code)
    assert not any("fxc.rms_norm" in line for line in code if line.startswith("-"))
    # the partitioned supertask graphs: embedding, one per block (identical blocks share one file), head
    index = (tmp_path / "supertasks" / "index.txt").read_text().splitlines()
    assert len(index) == 4 and all(" -> outputs " in line for line in index)
    files = sorted((tmp_path / "supertasks").glob("*.py"))
    assert len(files) == 3 and all("def forward" in f.read_text() for f in files)
    assert sum("qkv_paged_attention" in f.read_text() for f in files) == 1
    layout = next(s for s in summary if s["pass"] == "weight_layout")
    diff = (tmp_path / f"{layout['index']:02d}-weight_layout.diff.txt").read_text()
    assert "aten.linear.default" in diff and "aten.matmul.default" in diff
    assert "def forward" in (tmp_path / f"{layout['index']:02d}-weight_layout.after.py").read_text()
    assert "fxc.paged_attention" in (tmp_path / f"{layout['index']:02d}-weight_layout.after.dot").read_text()


def test_env_variable_switches_dumps_on(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("FXCOMPILER_DUMP_DIR", str(tmp_path / "env"))
    LLM(str(tiny_models["gpt2"]), max_seq_len_to_capture=128, cache_dir=None, skip_engine=True)
    assert (tmp_path / "env" / "summary.json").is_file()


def test_unknown_override_keys_are_rejected(tiny_models):
    with pytest.raises(ValueError, match="compiler_config_overrides"):
        LLM(str(tiny_models["llama"]), max_seq_len_to_capture=128, cache_dir=None,
            compiler_config_overrides={"npu_magic": 1})


def test_compile_command(tiny_models, tmp_path, capsys):
    rc = main(["compile", str(tiny_models["qwen2"]), "--max-seq-len-to-capture", "128", "--dump-dir",
               str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "unique graph blobs: 3" in out and "weight_layout" in out
    assert len(list(tmp_path.glob("*.after.py"))) == len(DEFAULT_PASSES)


def test_numeric_check_passes_for_the_default_pipeline(tiny_models):
    llm = LLM(str(tiny_models["mistral"]), max_seq_len_to_capture=128, cache_dir=None, skip_engine=True,
              compiler_config_overrides={"numeric_check": {"batch": 3, "tokens": 4, "context": 9}})
    assert [h["pass"] for h in llm.pass_history] == list(DEFAULT_PASSES)


def test_numeric_check_names_a_pass_that_changes_results(tiny_models):
    import torch

    from fxcompiler.pass_manager import PassError, PassResult

    def scale_logits(gm, ctx):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        with gm.graph.inserting_before(out):
            scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (out.args[0][0], 1.001))
        out.args = ((scaled,),)
        return PassResult(gm, True)

    with pytest.raises(PassError, match="numeric check: pass 'scale_logits' changed logits"):
        LLM(str(tiny_models["llama"]), max_seq_len_to_capture=128, cache_dir=None, skip_engine=True,
            compiler_config_overrides={"numeric_check": True,
                                       "passes": {"insert": [(scale_logits, {"after": "fuse_rope"})]}})
