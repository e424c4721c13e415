"""SamplingParams defaults, validation messages, from_optional, max_tokens finalisation."""

from __future__ import annotations

import pytest

from fxcompiler.sampling_params import RequestOutputKind, SamplingParams, SamplingType


def test_defaults():
    p = SamplingParams()
    assert (p.n, p.best_of, p.repetition_penalty, p.temperature) == (1, 1, 1.0, 1.0)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, -1, 0.0)
    assert (p.use_beam_search, p.length_penalty, p.early_stopping) == (False, 1.0, False)
    assert (p.max_tokens, p.min_tokens, p.logprobs) == (16, 0, None)
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.seed is None and p.stop == [] and p.stop_token_ids == []
    assert (p.include_stop_str_in_output, p.ignore_eos, p.skip_special_tokens) == (False, False, True)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias, p.prompt_logprobs) == (0.0, 0.0, None, None)
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


def test_keyword_only():
    with pytest.raises(TypeError):
        SamplingParams(1)  # type: ignore[misc]


def test_enums():
    assert RequestOutputKind.FINAL is RequestOutputKind.FINAL_ONLY
    assert [int(k) for k in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL)] == [0, 1, 2]
    assert [int(t) for t in (SamplingType.GREEDY, SamplingType.RANDOM, SamplingType.BEAM)] == [0, 1, 2]
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA


@pytest.mark.parametrize(
    "kwargs, field, rng",
    [
        ({"temperature": -1.0}, "temperature", ">= 0"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", "-1 or 0 (disable) or at least 1"),
        ({"min_p": 1.5}, "min_p", "[0, 1]"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": -3.0}, "frequency_penalty", "[-2, 2]"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "less than or equal to max_tokens=10"),
        ({"n": 0}, "n", "at least 1"),
        ({"n": 3, "best_of": 2}, "best_of", "greater than or equal to n"),
        ({"logprobs": -1}, "logprobs", ">= 0"),
        ({"prompt_logprobs": -2}, "prompt_logprobs", ">= 0"),
        ({"length_penalty": 0.5}, "length_penalty", "1.0"),
        ({"early_stopping": True}, "early_stopping", "False"),
        ({"use_beam_search": True, "best_of": 1}, "best_of", "greater than 1"),
        ({"use_beam_search": True, "best_of": 2, "early_stopping": "sometimes"}, "early_stopping", "'never'"),
        ({"temperature": 0.0, "best_of": 2}, "best_of", "must be 1"),
        ({"output_kind": 7}, "output_kind", "CUMULATIVE"),
    ],
)
def test_validation_messages_name_field(kwargs, field, rng):
    with pytest.raises(ValueError) as ei:
        SamplingParams(**kwargs)
    msg = str(ei.value)
    assert msg.startswith(field), msg
    assert rng in msg, msg


def test_exact_messages():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1.0"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"^top_k must be -1 or 0 \(disable\) or at least 1, got -3"):
        SamplingParams(top_k=-3)
    assert SamplingParams(top_k=0, temperature=1.0).top_k == -1  # vLLM's "0 disables"


@pytest.mark.parametrize(
    "kwargs",
    [{"n": 1.5}, {"n": True}, {"temperature": "1"}, {"stop": 3}, {"stop_token_ids": ["a"]},
     {"logit_bias": [1, 2]}, {"logit_bias": {1: "x"}}, {"max_tokens": 2.0}, {"ignore_eos": 1}],
)
def test_wrong_types(kwargs):
    with pytest.raises(TypeError):
        SamplingParams(**kwargs)


def test_normalisation():
    p = SamplingParams(seed=-1, logprobs=True, temperature=2, logit_bias={"5": -1})
    assert p.seed is None and p.logprobs == 1 and p.stop == [] and p.temperature == 2.0
    assert isinstance(p.temperature, float) and p.logit_bias == {5: -1.0}
    for stop in ("", ["a", "", "b"]):  # an empty stop string would match at once: refused, as in vLLM
        with pytest.raises(ValueError, match="stop cannot contain an empty string"):
            SamplingParams(stop=stop)
    assert SamplingParams(stop="x").stop == ["x"] and SamplingParams(stop=[]).stop == []
    assert SamplingParams(n=3).best_of == 3
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(prompt_logprobs=-1).prompt_logprobs == -1


def test_runtime_decided_values_are_valid():
    SamplingParams(n=2, best_of=4)
    SamplingParams(use_beam_search=True, best_of=4, length_penalty=0.7, early_stopping="never")
    SamplingParams(logprobs=5, prompt_logprobs=3)
    SamplingParams(repetition_penalty=3.0)


def test_greedy():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy and p.sampling_type is SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, -1, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(use_beam_search=True, best_of=2).sampling_type is SamplingType.BEAM


def test_clone_and_eq():
    p = SamplingParams(stop=["a"], logit_bias={1: 2.0})
    q = p.clone()
    assert p == q and p is not q
    q.stop.append("b")
    q.logit_bias[3] = 1.0
    assert p.stop == ["a"] and p.logit_bias == {1: 2.0}
    assert p != SamplingParams(stop=["a"])


def test_from_optional():
    p = SamplingParams.from_optional(temperature=None, top_k=None, max_tokens=None, n=None, top_p=0.5)
    assert p == SamplingParams(top_p=0.5)
    assert p.max_tokens == 16
    with pytest.raises(TypeError):
        SamplingParams.from_optional(nonsense=1)


def test_verify_and_finalize_max_tokens():
    p = SamplingParams(max_tokens=None)
    p.verify_and_finalize_max_tokens(prompt_len=10, max_prompt_len=100, max_context_len=128)
    assert p.max_tokens == 118

    p = SamplingParams(max_tokens=20)
    p.verify_and_finalize_max_tokens(10, 100, 128)
    assert p.max_tokens == 20

    with pytest.raises(ValueError) as ei:
        SamplingParams().verify_and_finalize_max_tokens(101, 100, 128)
    assert str(ei.value).startswith(
        "This model's maximum input context length is 100 tokens. However, your prompt resulted in 101 tokens."
    )

    with pytest.raises(ValueError) as ei:
        SamplingParams(max_tokens=30).verify_and_finalize_max_tokens(100, 100, 128)
    assert str(ei.value).startswith(
        "This model's maximum context length is 128 tokens. "
        "However, you requested 130 tokens (100 in the prompt, 30 for the completion)."
    )

    with pytest.raises(ValueError, match="maximum context length is 128 tokens"):
        SamplingParams(max_tokens=None).verify_and_finalize_max_tokens(128, 128, 128)

    with pytest.raises(ValueError, match="^min_tokens"):
        SamplingParams(max_tokens=None, min_tokens=50).verify_and_finalize_max_tokens(100, 100, 128)


def test_outputs_shape_and_repr():
    from fxcompiler.outputs import CompletionOutput, Logprob, RequestOutput

    c = CompletionOutput(0, "hi", [5, 2], logprobs=[{5: Logprob(-0.1, 1, "hi")}], finish_reason="stop")
    assert c.finished() and not CompletionOutput(0, "", []).finished()
    r = RequestOutput("req-0", "Say hi", [1, 2], [c], finished=True)
    text = repr(r)
    assert text.startswith("RequestOutput(request_id=req-0, prompt='Say hi', prompt_token_ids=[1, 2]")
    assert "CompletionOutput(index=0, text='hi', token_ids=[5, 2]" in text and "finished=True" in text
