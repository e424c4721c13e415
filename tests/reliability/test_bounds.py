"""Bounds on per-request work: each cap raises an error naming the field and the cap."""
from __future__ import annotations

import pytest

from fxcompiler import SamplingParams
from fxcompiler.sampling_params import LIMITS


@pytest.mark.parametrize("kwargs, match", [
    ({"logprobs": 21}, r"logprobs=21 exceeds the limit of 20"),
    ({"prompt_logprobs": 1000}, r"prompt_logprobs=1000 exceeds the limit of 20"),
    ({"n": 5000, "temperature": 1.0}, r"n=5000 exceeds the limit of 64 parallel samples"),
    ({"best_of": 65, "temperature": 1.0}, r"best_of=65 exceeds the limit of 64"),
    ({"stop": ["x"] * 65}, r"stop has 65 strings, at most 64"),
    ({"stop": ["y" * 2000]}, r"stop string has 2000 characters, at most 1024"),
    ({"stop_token_ids": list(range(2000))}, r"stop_token_ids has 2000 entries, at most 1024"),
    ({"logit_bias": {i: 1.0 for i in range(2000)}}, r"logit_bias has 2000 entries, at most 1024"),
    ({"seed": 2**70}, r"seed must be in \[-2\*\*63, 2\*\*64\)"),
])
def test_caps_raise_named_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_caps_can_be_raised_by_environment(monkeypatch):
    monkeypatch.setenv("FXCOMPILER_MAX_LOGPROBS", "50")
    assert SamplingParams(logprobs=40).logprobs == 40
    assert LIMITS["LOGPROBS"] == 20


def test_whole_vocabulary_prompt_logprobs_refused_by_the_engine(llm):
    with pytest.raises(ValueError, match=r"prompt_logprobs=-1 asks for the whole vocabulary \(256 entries\)"):
        llm.generate(None, SamplingParams(max_tokens=2, prompt_logprobs=-1), prompt_token_ids=[[1, 2, 3]])
    assert not llm.engine.requests
