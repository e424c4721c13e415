"""``fxcompiler serve`` as a subprocess on 127.0.0.1, driven with the official ``openai`` client.

One server process for the module (a tiny random-weight chat model); the reference outputs come
from an in-process ``LLM`` built with the same engine options.
"""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from fxcompiler import LLM, SamplingParams
from fxcompiler.engine_args import EngineArgs

from .server_process import start_server
from .tiny_chat_model import save_tiny_chat_model

pytestmark = pytest.mark.slow

NAME = "tiny"
KEY = "test-key"
PROMPTS = ["def foo(x): return", "The class statement", "import sys", "while True:"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a class?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    model = save_tiny_chat_model(work / "model")
    srv = start_server(model, work, served_name=NAME, api_key=KEY,
                       extra_flags=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    srv.extra["model"] = model
    srv.extra["work"] = work
    yield srv
    code = srv.stop()
    assert code == 0, f"the server did not shut down cleanly on SIGTERM (exit {code}):\n{srv.log()}"
    assert "Traceback" not in srv.log_path.read_text(errors="replace"), srv.log()  # no unhandled error logged


@pytest.fixture(scope="module")
def llm(server):
    args = EngineArgs(model=str(server.extra["model"]), max_seq_len_to_capture=512, threads=1,
                      prefill_buckets=[(1, 64), (4, 64)], decode_buckets=[(1, 512), (16, 512), (64, 512)],
                      cache_dir=str(server.extra["work"] / "cache"))
    with LLM.from_engine_args(args) as llm:
        yield llm


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(fxcompiler:[a-z0-9_]+)(\{[^}]*\})? ([-+0-9.eE]+|NaN)$', line)
        if m:
            reason = re.search(r'finished_reason="([a-z]+)"', m.group(2) or "")
            key = m.group(1) + (f"[{reason.group(1)}]" if reason else "")
            out[key] = float(m.group(3))
    return out


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    assert "version" in httpx.get(server.base_url + "/version", timeout=10).json()
    m = metrics(server)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate",
                 "num_preemptions_total", "time_to_first_token_seconds_count",
                 "time_per_output_token_seconds_count", "e2e_request_latency_seconds_count"):
        assert f"fxcompiler:{name}" in m, name


def test_greedy_completions_and_chat_equal_llm(client, llm):
    ref = llm.generate(PROMPTS, greedy())
    r = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in r.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in ref]
    assert r.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in ref)
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in ref)
    want = llm.chat(CHAT, greedy())[0].outputs[0]
    c = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=12, temperature=0)
    assert c.choices[0].message.role == "assistant" and c.choices[0].message.content == want.text
    assert c.usage.completion_tokens == len(want.token_ids)
    c2 = client.chat.completions.create(model=NAME, messages=CHAT, max_completion_tokens=12, temperature=0)
    assert c2.choices[0].message.content == want.text


def test_streaming_with_usage(client, llm):
    want = llm.chat(CHAT, greedy(16))[0].outputs[0]
    chunks = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert all(ch.usage is None for ch in chunks[:-1])
    # vLLM's continuous_usage_stats (what the chat page counts tokens with): the running usage in every chunk
    # The engine merges the deltas a slow consumer has not taken yet, so how many chunks carry the 16
    # tokens depends on timing; each chunk's logprobs name its tokens, and the running usage must count them.
    cont = list(client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=16, temperature=0, stream=True,
                                               logprobs=True,
                                               extra_body={"stream_options": {"include_usage": True,
                                                                              "continuous_usage_stats": True}}))
    counts = [ch.usage.completion_tokens for ch in cont]
    assert counts == sorted(counts) and counts[-1] == len(want.token_ids), counts
    sent = 0
    for ch in cont:
        if ch.choices and ch.choices[0].logprobs is not None:
            sent += len(ch.choices[0].logprobs.content)
        assert ch.usage.completion_tokens == sent, (counts, sent)
    assert sent == len(want.token_ids)
    assert "".join(ch.choices[0].delta.content or "" for ch in cont if ch.choices) == want.text
    ref = llm.generate(PROMPTS[0], greedy(16)).outputs[0]
    cchunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in cchunks if ch.choices) == ref.text
    assert cchunks[-1].usage.completion_tokens == len(ref.token_ids)
    # without include_usage no usage chunk is sent
    plain = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, stream=True))
    assert all(ch.choices for ch in plain)


def test_n2_and_seed(client, llm):
    p = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10)
    ref = llm.generate(PROMPTS[2], p)
    r = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=10, temperature=1.0, seed=7, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.text for o in ref.outputs]
    again = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=10, temperature=1.0, seed=7, n=2)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    other = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=10, temperature=1.0, seed=8, n=2)
    assert [c.text for c in other.choices] != [c.text for c in r.choices]
    # streamed chat with n = 2: every choice streams, and equals the non-streamed one of the same seed
    full = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=10, temperature=1.0, seed=3, n=2)
    texts = {0: "", 1: ""}
    finished = set()
    for ch in client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=10, temperature=1.0, seed=3,
                                             n=2, stream=True):
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in sorted(full.choices, key=lambda c: c.index)]
    # best_of (OpenAI's completions): best_of samples, the n most likely returned, as LLM.generate does
    ref = llm.generate(PROMPTS[1], SamplingParams(n=2, best_of=4, temperature=1.0, seed=5, max_tokens=8))
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, seed=5, n=2,
                                  best_of=4)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.text for o in ref.outputs]
    with pytest.raises(openai.BadRequestError, match="best_of must equal n when streaming"):
        client.completions.create(model=NAME, prompt="x", max_tokens=2, n=1, best_of=2, stream=True)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=NAME, prompt="x", max_tokens=2, n=3, best_of=2)


def test_stop(client, llm):
    full = llm.generate(PROMPTS[1], greedy(24)).outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    want = llm.generate(PROMPTS[1], greedy(24, stop=[stop])).outputs[0]
    assert want.finish_reason == "stop"
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=stop, stream=True) if ch.choices)
    assert streamed == want.text


def test_logprobs(client, llm):
    ref = llm.generate(PROMPTS[3], greedy(8, logprobs=3)).outputs[0]
    r = client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ref.token_ids) == len(lp.token_logprobs) == len(lp.top_logprobs)
    for tok, got, tops, entry in zip(ref.token_ids, lp.token_logprobs, lp.top_logprobs, ref.logprobs):
        assert got == pytest.approx(entry[tok].logprob, abs=1e-4)
        assert 3 <= len(tops) <= 4 and max(tops.values()) == pytest.approx(got, abs=1e-4)  # greedy: the top one
    c = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
               and t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4) for t in content)


def test_echo_scores_the_prompt_and_prompt_logprobs(client, llm):
    """echo with logprobs scores the echoed prompt too (the first token null, as vLLM; what lm-eval's
    loglikelihood requests read), streamed or not; vLLM's prompt_logprobs per choice."""
    ref = llm.generate(PROMPTS[3], greedy(3, logprobs=2, prompt_logprobs=2))
    ids, out = ref.prompt_token_ids, ref.outputs[0]
    P = len(ids)
    r = client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=3, temperature=0, logprobs=2, echo=True)
    choice = r.choices[0]
    assert choice.text == PROMPTS[3] + out.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == P + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [ref.prompt_logprobs[p][ids[p]].logprob for p in range(1, P)] + \
        [e[t].logprob for t, e in zip(out.token_ids, out.logprobs)]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # streamed: the first chunk echoes the prompt with its logprobs, the rest continue the offsets
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=3, temperature=0, logprobs=2,
                                            echo=True, stream=True))
    assert chunks[0].choices[0].text == PROMPTS[3]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == choice.text
    streamed = [x for ch in chunks if ch.choices for x in ch.choices[0].logprobs.token_logprobs]
    offsets = [x for ch in chunks if ch.choices for x in ch.choices[0].logprobs.text_offset]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    # the prompt's offsets are the same; the completion's follow the text sent so far (a token whose text the
    # detokenizer holds back, a partial UTF-8 character, moves them later than its decoded length would)
    assert offsets[:P + 1] == lp.text_offset[:P + 1] and offsets == sorted(offsets)
    # echo without logprobs, and a token-id prompt: its tokens decoded
    plain = client.completions.create(model=NAME, prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text == llm.tokenizer.decode(ids) + out.text
    # vLLM's prompt_logprobs: per position null or {token id: {logprob, rank, decoded_token}}
    r = client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 1})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == P and got[0] is None
    for p in range(1, P):
        entry = got[p][str(ids[p])]
        assert entry["logprob"] == pytest.approx(ref.prompt_logprobs[p][ids[p]].logprob, abs=1e-4)
        assert 1 <= len(got[p]) <= 2 and any(v["rank"] == 1 for v in got[p].values())


SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "n"], "additionalProperties": False}


def test_structured_output(client):
    import jsonschema

    rf = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=60, temperature=1.0, seed=1, n=2,
                                       response_format=rf)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=60, temperature=0, response_format=rf, stream=True) if ch.choices)
    jsonschema.validate(json.loads(streamed), SCHEMA)
    obj = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=40, temperature=0,
                                         response_format={"type": "json_object"})
    c = obj.choices[0]  # any object: its strings are unbounded, so a random model may not close it in time
    assert c.message.content.startswith("{") and c.finish_reason in ("stop", "length")
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    pick = client.completions.create(model=NAME, prompt="Pick:", max_tokens=10, temperature=0,
                                     extra_body={"guided_choice": ["left", "right"]})
    assert pick.choices[0].text in ("left", "right")
    rx = client.completions.create(model=NAME, prompt="Code:", max_tokens=10, temperature=0,
                                   extra_body={"guided_regex": "[A-Z]{2}[0-9]{2}"})
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", rx.choices[0].text)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 8},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                               "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                        "additionalProperties": False}}}]


def test_tools(client):
    import jsonschema

    ask = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=NAME, messages=ask, tools=TOOLS, tool_choice=named, max_tokens=60,
                                       temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    req = client.chat.completions.create(model=NAME, messages=ask, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=100, temperature=1.0, seed=2)
    calls = req.choices[0].message.tool_calls
    assert req.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    for call in calls:
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    # auto + the hermes parser: the output (forced into hermes' shape here) becomes tool calls
    hermes = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", "days": [1-7]\}\}</tool_call>'
    auto = client.chat.completions.create(model=NAME, messages=ask, tools=TOOLS, max_tokens=100, temperature=0,
                                          extra_body={"guided_regex": hermes})
    assert auto.choices[0].message.tool_calls, auto.choices[0]
    (call,) = auto.choices[0].message.tool_calls
    assert auto.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    # streamed: content, then the call's header (id, name), then its arguments piece by piece
    hermes = r"Sure\. " + hermes
    whole = client.chat.completions.create(model=NAME, messages=ask, tools=TOOLS, max_tokens=100, temperature=0,
                                           extra_body={"guided_regex": hermes}).choices[0]
    assert_streamed_calls(lambda: client.chat.completions.create(
        model=NAME, messages=ask, tools=TOOLS, max_tokens=100, temperature=0, stream=True,
        extra_body={"guided_regex": hermes}), whole)
    # auto without a call in the output: plain content
    plain = client.chat.completions.create(model=NAME, messages=ask, tools=TOOLS, max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    none = client.chat.completions.create(model=NAME, messages=ask, tools=TOOLS, tool_choice="none", max_tokens=8,
                                          temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content


def streamed_calls(chunks, whole) -> dict[int, dict]:
    """The stream's content and tool-call deltas assemble into the non-streamed message ``whole`` (each call's
    header first); returns per call index its name, arguments and the number of pieces they came in."""
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or ())]
    calls: dict[int, dict] = {}
    for tc in deltas:
        c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": "", "pieces": 0})
        if tc.id:
            assert c["id"] is None and tc.type == "function" and tc.function.arguments == "", tc  # the header
            c["id"] = tc.id
        assert c["id"], f"arguments before the header: {tc}"
        c["name"] += tc.function.name or ""
        c["arguments"] += tc.function.arguments or ""
        c["pieces"] += bool(tc.function.arguments)
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == (whole.message.content or "")
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls" == whole.finish_reason
    return calls


def assert_streamed_calls(stream, whole, min_pieces: dict[int, int] | None = None, attempts: int = 3) -> None:
    """Each stream of ``stream()`` assembles into ``whole`` (``streamed_calls``), and the arguments of each call
    come as the model writes them, in more than one piece (``min_pieces``: call index -> fewer allowed).  The
    server merges the deltas its consumer has not taken yet (``serving/engine.py``): when this process or the
    server's event loop is descheduled for a few milliseconds, the tiny model writes a whole call in that time and
    the call comes in one piece.  So a stream of fewer pieces is asked again, up to ``attempts`` streams; one
    that never streams the arguments in pieces fails every time."""
    tries = []
    for _ in range(attempts):
        calls = streamed_calls(list(stream()), whole)
        tries.append(calls)
        if all(c["pieces"] >= (min_pieces or {}).get(k, 2) for k, c in calls.items()):
            return
    raise AssertionError(f"the arguments never came in pieces in {attempts} streams: {tries}")


def test_streamed_tool_calls_llama3_json(llm):
    """``--tool-call-parser llama3_json``: an in-process app on the reference LLM, driven by the openai client."""
    from fastapi.testclient import TestClient

    from fxcompiler.serving import AsyncLLMEngine, LLMEngine
    from fxcompiler.serving.api_server import build_app

    two_calls = (r'<\|python_tag\|>\{"name": "get_weather", "parameters": \{"city": "[a-z]{1,6}", "days": [1-7]\}\}; '
                 r'\{"name": "now", "parameters": \{\}\}')
    ask = [{"role": "user", "content": "Weather in Paris, and the time?"}]
    engine = AsyncLLMEngine(LLMEngine(llm))
    try:
        with TestClient(build_app(engine, model_name=NAME, tool_call_parser="llama3_json")) as http:
            local = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
            kw = dict(model=NAME, messages=ask, tools=TOOLS, max_tokens=100, temperature=0,
                      extra_body={"guided_regex": two_calls})
            whole = local.chat.completions.create(**kw).choices[0]
            assert [t.function.name for t in whole.message.tool_calls] == ["get_weather", "now"]
            assert_streamed_calls(lambda: local.chat.completions.create(stream=True, **kw), whole, min_pieces={1: 1})
    finally:
        engine.shutdown()


def _malformed() -> list[tuple[str, object, int]]:
    """(route, body — bytes are sent raw, dict as JSON —, expected status)."""
    long_prompt = " ".join(["class"] * 1200)  # longer than the 512-token context
    cm, ch = "/v1/completions", "/v1/chat/completions"
    ok = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    okc = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return [
        (cm, b"{bad json", 400), (cm, b"", 400), (cm, b"[1, 2]", 400), (cm, {"model": NAME}, 400),
        (cm, {**ok, "prompt": 42}, 400), (cm, {**ok, "prompt": []}, 400), (cm, {**ok, "prompt": ["a", 1]}, 400),
        (cm, {**ok, "max_tokens": -1}, 400), (cm, {**ok, "max_tokens": "ten"}, 400),
        (cm, {**ok, "temperature": 5}, 400), (cm, {**ok, "temperature": "hot"}, 400),
        (cm, {**ok, "top_p": 0}, 400), (cm, {**ok, "top_p": 1.5}, 400), (cm, {**ok, "n": 0}, 400),
        (cm, {**ok, "n": "two"}, 400), (cm, {**ok, "logprobs": 50}, 400), (cm, {**ok, "presence_penalty": 3}, 400),
        (cm, {**ok, "frequency_penalty": -3}, 400), (cm, {**ok, "model": "no-such-model"}, 404),
        (cm, {**ok, "prompt": long_prompt}, 400), (cm, {**ok, "prompt": [999999]}, 400),
        (cm, {**ok, "stop": 5}, 400), (cm, {**ok, "stream_options": {"include_usage": True}}, 400),
        (cm, {**ok, "logit_bias": {"abc": 1}}, 400), (cm, {**ok, "seed": "x"}, 400),
        (cm, {**ok, "n": 2, "temperature": 0}, 400), (cm, {**ok, "max_tokens": 100000}, 400),
        (cm, {**ok, "min_p": 2}, 400), (cm, {**ok, "repetition_penalty": 0}, 400),
        (ch, {"model": NAME}, 400), (ch, {**okc, "messages": []}, 400),
        (ch, {**okc, "messages": [{"role": "wizard", "content": "x"}]}, 400), (ch, {**okc, "messages": "hi"}, 400),
        (ch, {**okc, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, 400),
        (ch, {**okc, "top_logprobs": 2}, 400), (ch, {**okc, "logprobs": True, "top_logprobs": 30}, 400),
        (ch, {**okc, "model": "no-such-model"}, 404), (ch, {**okc, "max_completion_tokens": 0}, 400),
        (ch, {**okc, "tools": [{"type": "function"}]}, 400), (ch, {**okc, "tools": "x"}, 400),
        (ch, {**okc, "tools": [{"type": "function", "function": {"name": 3}}]}, 400),
        (ch, {**okc, "messages": [{"role": "user", "content": long_prompt}]}, 400),
        (ch, {**okc, "response_format": {"type": "xml"}}, 400),
        (ch, {**okc, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400),
        (ch, {**okc, "tools": TOOLS, "tool_choice": "sometimes"}, 400), (ch, {**okc, "tool_choice": "required"}, 400),
        (ch, {**okc, "tools": [TOOLS[0], TOOLS[0]]}, 400),
        (ch, {**okc, "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, 400),
        (ch, {**okc, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400),
        (ch, {**okc, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}}, 400),
        (cm, {**ok, "guided_regex": "[unclosed"}, 400), (cm, {**ok, "guided_choice": []}, 400),
        (cm, {**ok, "guided_regex": "a", "guided_choice": ["a"]}, 400),
        (cm, {**ok, "stop": ""}, 400), (ch, {**okc, "stop": ["x", ""]}, 400),
    ]


def test_malformed_requests_get_openai_errors(server, client):
    headers = {"Authorization": f"Bearer {KEY}"}
    cases = _malformed()
    assert len(cases) >= 30
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        for route, body, status in cases:
            if isinstance(body, bytes):
                r = http.post(route, content=body, headers={**headers, "content-type": "application/json"})
            else:
                r = http.post(route, json=body, headers=headers)
            assert r.status_code == status, (route, body, r.status_code, r.text)
            err = r.json()["error"]
            assert isinstance(err["message"], str) and err["message"], (body, err)
            assert isinstance(err["type"], str) and err["code"] == status, (body, err)
        r = http.post("/v1/completions", json={"model": NAME, "prompt": "hi", "stop": ["x", ""]}, headers=headers)
        assert r.json()["error"]["param"] == "stop" and "empty string" in r.json()["error"]["message"]
        for hdr in ({}, {"Authorization": "Bearer wrong"}):  # --api-key: /v1 routes need the key
            r = http.post("/v1/completions", json={"model": NAME, "prompt": "hi"}, headers=hdr)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert http.get("/health").status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=3, temperature=0).choices[0].text is not None


def test_concurrent_streams_and_disconnects(server):
    idle = metrics(server)
    aborted_before = idle.get("fxcompiler:request_success_total[abort]", 0.0)
    n_done, n_gone = 200, 50  # the acceptance scale

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0,
                                      timeout=300) as aclient:
            async def complete(i):
                stream = await aclient.chat.completions.create(
                    model=NAME, messages=[{"role": "user", "content": f"item {i}"}], max_tokens=12,
                    temperature=1.0, seed=i, stream=True, extra_body={"ignore_eos": True})
                text, finish = "", None
                async for ch in stream:
                    for c in ch.choices:
                        text += c.delta.content or ""
                        finish = c.finish_reason or finish
                return text, finish

            async def disconnect(i):
                stream = await aclient.completions.create(model=NAME, prompt=f"while {i}:", max_tokens=480,
                                                          temperature=1.0, stream=True,
                                                          extra_body={"ignore_eos": True})
                async for ch in stream:
                    if ch.choices and ch.choices[0].text:
                        break
                await stream.close()  # the client goes away mid-stream

            return await asyncio.gather(*[complete(i) for i in range(n_done)],
                                        *[disconnect(i) for i in range(n_gone)])

    results = asyncio.run(main())[:n_done]
    assert all(finish == "length" for _, finish in results), results
    m = metrics(server)
    for _ in range(120):  # bounded: the aborted requests leave the engine
        if (m["fxcompiler:num_requests_running"] == 0 and m["fxcompiler:num_requests_waiting"] == 0
                and m["fxcompiler:request_success_total[abort]"] - aborted_before == n_gone):
            break
        time.sleep(0.5)
        m = metrics(server)
    assert m["fxcompiler:num_requests_running"] == 0 and m["fxcompiler:num_requests_waiting"] == 0
    assert m["fxcompiler:request_success_total[abort]"] - aborted_before == n_gone
    assert m["fxcompiler:kv_cache_usage_perc"] == idle["fxcompiler:kv_cache_usage_perc"]
    assert m["fxcompiler:request_success_total[length]"] >= n_done
    r = httpx.post(server.base_url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": NAME, "prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and json.loads(r.text)["choices"]


def test_bench_serve(server, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "fxcompiler.cli", "bench", "serve", "--base-url", server.base_url,
                           "--api-key", KEY, "--num-prompts", "12", "--max-concurrency", "4", "--request-rate", "50",
                           "--input-len", "8", "--output-len", "6", "--no-progress", "--result-json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["completed"] == 12 and res["failed"] == 0
    assert res["output_throughput"] > 0 and res["request_throughput"] > 0
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = res[name]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], (name, d)
    assert res["ttft_ms"]["p99"] <= res["e2e_ms"]["p99"]
    assert "TTFT" in proc.stdout and "p99" in proc.stdout


def test_speculating_quantized_server_is_lossless_and_counts_drafts(server, tmp_path):
    """``serve --quantization W8A16 --speculative-model [ngram]``: greedy answers equal the same quantized
    model's without a speculator (in-process), and ``/metrics`` counts the verified drafts."""
    flags = ["--quantization", "W8A16"]
    prompts = ["x = 1\nx = 1\nx = 1\nx = 1\nx =", "for i in range(3): for i in range(3): for i in"]
    srv = start_server(server.extra["model"], tmp_path, served_name=NAME,
                       extra_flags=[*flags, "--speculative-model", "[ngram]", "--num-speculative-tokens", "3"])
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(model=NAME, prompt=prompts, max_tokens=24, temperature=0)
        args = EngineArgs(model=str(server.extra["model"]), max_seq_len_to_capture=512, threads=1,
                          prefill_buckets=[(1, 64), (4, 64)], decode_buckets=[(1, 512), (16, 512), (64, 512)],
                          cache_dir=str(tmp_path / "cache"), quantization="W8A16")
        with LLM.from_engine_args(args) as plain:
            assert plain.num_speculative_tokens is None and plain.quantization["weight"] == "int8"
            ref = plain.generate(prompts, greedy(24))
        assert [c.text for c in r.choices] == [o.outputs[0].text for o in ref]
        m = srv.metrics()
        drafts, proposed = m["fxcompiler:spec_decode_num_drafts_total"], m["fxcompiler:spec_decode_num_draft_tokens_total"]
        assert drafts > 0 and drafts <= proposed <= 3 * drafts, m
        assert 0 <= m["fxcompiler:spec_decode_num_accepted_tokens_total"] <= proposed
    finally:
        assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log_path.read_text(errors="replace"), srv.log()
    assert server.metrics()["fxcompiler:spec_decode_num_drafts_total"] == 0  # the plain server drafts nothing


def test_tokenize_detokenize(server, llm):
    """vLLM's ``/tokenize`` (a prompt, or chat messages through the chat template) and ``/detokenize``."""
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.base_url + "/tokenize", json={"model": NAME, "prompt": PROMPTS[0]}, headers=headers)
    ids = llm.tokenizer.encode(PROMPTS[0])
    assert r.status_code == 200 and r.json() == {"count": len(ids), "max_model_len": 512, "tokens": ids}, r.text
    r = httpx.post(server.base_url + "/tokenize", json={"messages": CHAT}, headers=headers)
    text = llm.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    chat_ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert r.status_code == 200 and r.json()["tokens"] == chat_ids, r.text
    # the chat request's prompt is exactly these tokens
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=NAME, messages=CHAT, max_tokens=1, temperature=0)
    assert c.usage.prompt_tokens == len(chat_ids)
    r = httpx.post(server.base_url + "/detokenize", json={"tokens": ids}, headers=headers)
    assert r.status_code == 200 and r.json() == {"prompt": llm.tokenizer.decode(ids)}
    r = httpx.post(server.base_url + "/detokenize", json={"tokens": [-1]}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    # --api-key guards the tokenizer routes too (vLLM leaves them open)
    for route in ("/tokenize", "/detokenize"):
        r = httpx.post(server.base_url + route, json={"prompt": "x", "tokens": [1]})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401


def test_serve_an_artifact(server, llm, tmp_path):
    """``fxcompiler serve ARTIFACT``: a directory from ``fxcompiler build`` is loaded (no export, no passes) and
    answers as the model it was built from."""
    import subprocess
    import sys

    out = tmp_path / "artifact"
    proc = subprocess.run([sys.executable, "-m", "fxcompiler.cli", "build", str(server.extra["model"]), str(out),
                           "-pb", "1,64", "-db", "1,512", "--max-seq-len-to-capture", "512", "--threads", "1",
                           "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    srv = start_server(out, tmp_path, served_name=NAME, base_flags=["--threads", "1"])
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0)
        assert r.choices[0].text == llm.generate(PROMPTS[0], greedy()).outputs[0].text
    finally:
        assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log_path.read_text(errors="replace"), srv.log()
