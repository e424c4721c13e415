"""Fixtures of the reliability suite: one tiny llama checkpoint, a private cache, a shared LLM."""
from __future__ import annotations

import pytest

from fxcompiler import LLM

from ..conftest import save_tiny_model

PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 3]]


@pytest.fixture(scope="package")
def llama_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("rel") / "llama", "llama")


@pytest.fixture(scope="package")
def rel_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("relcache")


@pytest.fixture(scope="package")
def llm(llama_dir, rel_cache):
    obj = LLM(str(llama_dir), max_seq_len_to_capture=128, cache_dir=rel_cache)
    yield obj
    obj.shutdown()


def make_llm(llama_dir, cache, **kw) -> LLM:
    return LLM(str(llama_dir), max_seq_len_to_capture=128, cache_dir=cache, **kw)
