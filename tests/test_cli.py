"""The command line: ``fxcompiler generate`` and an interactive ``fxcompiler chat`` session."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "fxcompiler.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=600, env=env)


# --threads 1: the thread count is part of the compile-cache key, and the suite's in-process builds of the
# default model run at one thread per xdist worker, so these commands load those builds instead of making more.
def test_generate_prints_text_and_tokens_per_second():
    r = run_cli("generate", "-p", "The capital of France is", "--max-tokens", "8", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "### The capital of France is" in r.stdout and "Paris" in r.stdout
    assert "tokens/s" in r.stderr


def test_chat_streams_replies_until_an_empty_line():
    r = run_cli("chat", "--max-tokens", "16", "--threads", "1", stdin="What is the capital of France?\n\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_bad_arguments_are_reported_not_raised():
    r = run_cli("generate", "--model", "no/such-model", "--max-tokens", "2")
    assert r.returncode == 2 and "Unknown model" in r.stderr
    r = run_cli("generate", "--device", "tpu:0", "--max-tokens", "2")
    assert r.returncode == 2 and "invalid device" in r.stderr
