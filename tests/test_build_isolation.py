"""``compile_in_subprocess`` (fxcompiler/build_isolation.py): on a compile-cache miss a child process exports and
optimises the model and builds the bucket pipelines; this process loads both from the caches and generates what
an in-process build generates. A child that fails leaves the build to this process."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from fxcompiler import LLM, SamplingParams
from fxcompiler.engine_args import EngineArgs

from .conftest import save_tiny_model

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 3]]
SP = SamplingParams(max_tokens=10, temperature=0)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(None, SP, prompt_token_ids=PROMPTS)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("iso") / "llama", "llama")


def test_the_child_builds_and_this_process_loads_the_same_program(llama, tmp_path):
    isolated = LLM(str(llama), max_seq_len_to_capture=64, cache_dir=tmp_path / "a", compile_in_subprocess=True)
    info = isolated.build_info
    assert info["compile_cache"] == "miss" and info["compiled_in"] == "subprocess"
    assert info["build_cache"] == "hit"  # the child built the bucket pipelines too
    in_process = LLM(str(llama), max_seq_len_to_capture=64, cache_dir=tmp_path / "b")
    assert in_process.build_info["compile_cache"] == "miss" and "compiled_in" not in in_process.build_info
    assert in_process.build_info["cache_key"] == info["cache_key"]
    assert _tokens(isolated) == _tokens(in_process)
    again = LLM(str(llama), max_seq_len_to_capture=64, cache_dir=tmp_path / "a", compile_in_subprocess=True)
    assert again.build_info["compile_cache"] == "hit" and "compiled_in" not in again.build_info  # no child on a hit


def test_a_failing_child_leaves_the_build_to_this_process(llama, tmp_path, monkeypatch, caplog):
    from fxcompiler import build_isolation

    def failing_run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, stdout=b"", stderr=b"Traceback: simulated failure in the child")

    monkeypatch.setattr(build_isolation.subprocess, "run", failing_run)
    with caplog.at_level(logging.WARNING, logger="fxcompiler.build"):
        llm = LLM(str(llama), max_seq_len_to_capture=64, cache_dir=tmp_path, compile_in_subprocess=True)
    assert llm.build_info["compile_cache"] == "miss" and "compiled_in" not in llm.build_info
    assert any("simulated failure in the child" in r.getMessage() and "building in this process" in r.getMessage()
               for r in caplog.records)
    assert len(_tokens(llm)[0]) == SP.max_tokens


def test_a_child_with_another_cache_key_is_refused(llama, tmp_path, monkeypatch, caplog):
    """The child checks that it computed the parent's key; a mismatch is a failure (then built here)."""
    from fxcompiler import build_isolation

    real = build_isolation.compile_in_child

    def wrong_key(request, loaded, *, device, cache_dir, key, fx_build=None):
        return real(request, loaded, device=device, cache_dir=cache_dir, key="0" * 32, fx_build=fx_build)

    monkeypatch.setattr(build_isolation, "compile_in_child", wrong_key)
    with caplog.at_level(logging.WARNING, logger="fxcompiler.build"):
        llm = LLM(str(llama), max_seq_len_to_capture=64, cache_dir=tmp_path, compile_in_subprocess=True)
    assert "compiled_in" not in llm.build_info
    assert any("is not the parent's" in r.getMessage() for r in caplog.records)


def test_the_option_is_validated_and_reaches_the_cli():
    with pytest.raises(TypeError, match="compile_in_subprocess must be a bool"):
        LLM("unused-model-id", compile_in_subprocess="yes")
    with pytest.raises(TypeError, match="compile_in_subprocess must be a bool"):
        EngineArgs(compile_in_subprocess=1)
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--compile-in-subprocess"]))
    assert args.compile_in_subprocess and args.llm_kwargs()["compile_in_subprocess"] is True
    assert "compile_in_subprocess" not in EngineArgs().llm_kwargs()
