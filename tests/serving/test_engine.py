"""Engine API: LLMEngine step by step, AsyncLLMEngine streams (kinds, abort, fairness), streaming semantics."""
from __future__ import annotations

import asyncio

import pytest

from fxcompiler import LLM, SamplingParams
from fxcompiler.config import ManualBucketConfig
from fxcompiler.engine_args import EngineArgs
from fxcompiler.sampling_params import RequestOutputKind
from fxcompiler.serving import AsyncLLMEngine, LLMEngine

from .tiny_chat_model import save_tiny_chat_model

pytestmark = pytest.mark.slow

BUCKETS = dict(prefill_buckets=[(1, 64), (4, 64)], decode_buckets=[(1, 128), (16, 128)])
# the model's generation_config.json and the SamplingParams defaults it means (tests/test_generation_defaults.py)
GEN_CONFIG = {"temperature": 1.0, "top_k": 3, "top_p": 0.9, "repetition_penalty": 1.05, "max_new_tokens": 6}
GEN_DEFAULTS = {"temperature": 1.0, "top_k": 3, "top_p": 0.9, "repetition_penalty": 1.05, "max_tokens": 6}
PROMPTS = ["def foo(x): return", "The class statement", "import sys", "for i in range(10):", "while True:"]


@pytest.fixture(scope="module")
def engine_args(tmp_path_factory):
    # a sampling generation_config.json: test_generation_config_defaults_* (the other tests set every field)
    path = save_tiny_chat_model(tmp_path_factory.mktemp("tinychat") / "model", generation_config=GEN_CONFIG)
    return EngineArgs(model=str(path), max_seq_len_to_capture=128, cache_dir=str(tmp_path_factory.mktemp("c")),
                      **BUCKETS)


@pytest.fixture(scope="module")
def llm(engine_args):
    return LLM.from_engine_args(engine_args)


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_engine_args_round_trip_through_the_cli():
    import argparse

    p = EngineArgs.add_cli_args(argparse.ArgumentParser(), positional_model=True)
    ns = p.parse_args(["some/model", "-pb", "1,64", "-db", "4,128", "--no-enable-prefix-caching", "-tp", "1",
                       "--npu-queue-limit", "3", "--spare-blocks-ratio", "0.25"])
    a = EngineArgs.from_cli_args(ns)
    assert a.prefill_buckets == [(1, 64)] and a.decode_buckets == [(4, 128)]
    assert a.enable_prefix_caching is False and a.npu_queue_limit == 3
    kw = a.llm_kwargs()
    assert kw["bucket_config"] == ManualBucketConfig([(1, 64)], [(4, 128)])
    assert kw["scheduler_config"].npu_queue_limit == 3 and kw["scheduler_config"].spare_blocks_ratio == 0.25
    with pytest.raises(ValueError, match="spare_blocks_ratio"):
        EngineArgs(spare_blocks_ratio=1.5)
    with pytest.raises(ValueError, match="npu_queue_limit"):
        EngineArgs(npu_queue_limit=0)
    with pytest.raises(ValueError, match="max_prompt_len"):
        EngineArgs(max_prompt_len=4096, max_seq_len_to_capture=2048)
    with pytest.raises(ValueError, match="prefill_buckets and decode_buckets"):
        EngineArgs(prefill_buckets=[(1, 64)])


def test_engine_args_quantization_and_speculation_flags(tmp_path):
    """The quantization and speculative-decoding options reach ``LLM(...)`` from the flags that ``serve``,
    ``generate``, ``chat``, ``compile`` and ``build`` share; bad values name the argument."""
    import argparse

    from fxcompiler import cli
    from fxcompiler.quant_config import QuantizationConfig

    p = EngineArgs.add_cli_args(argparse.ArgumentParser(), positional_model=True)
    a = EngineArgs.from_cli_args(p.parse_args([
        "m", "--quantization", "W4A16", "--quantization-group-size", "64", "--no-quantize-lm-head",
        "--keep-gguf-quantization", "--speculative-model", "[ngram]:2:4", "--num-speculative-tokens", "3",
        "--device", "cpu", "--prefill-bucket", "1,64", "-db", "2,64"]))
    kw = a.llm_kwargs()
    assert kw["llm_config"].quantization_config == QuantizationConfig.from_str("W4A16")
    assert (kw["quantization_group_size"], kw["quantize_lm_head"], kw["keep_gguf_quantization"]) == (64, False, True)
    assert (kw["speculative_model"], kw["num_speculative_tokens"], kw["devices"]) == ("[ngram]:2:4", 3, "cpu")
    assert kw["bucket_config"] == ManualBucketConfig([(1, 64)], [(2, 64)])
    vllm_names = EngineArgs.from_cli_args(p.parse_args(["m", "--max-model-len", "256", "--max-num-seqs", "8",
                                                        "--block-size", "32"]))
    assert (vllm_names.max_seq_len_to_capture, vllm_names.max_processing_samples,
            vllm_names.paged_attention_block_size) == (256, 8, 32)
    plain = EngineArgs(model="m").llm_kwargs()
    assert not {"llm_config", "quantize_lm_head", "keep_gguf_quantization", "speculative_model"} & set(plain)
    with pytest.raises(ValueError, match="quantization: not a quantization scheme string: 'W9A9'"):
        EngineArgs(quantization="W9A9")
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 1"):
        EngineArgs(speculative_model="[ngram]", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="num_speculative_tokens needs speculative_model"):
        EngineArgs(num_speculative_tokens=2)
    draft = EngineArgs(model="m", speculative_model="m", speculative_model_quantization="W4A8").llm_kwargs()
    assert draft["speculative_model_llm_config"].quantization_config == QuantizationConfig.from_str("W4A8")
    assert "llm_config" not in draft  # the target stays unquantized
    with pytest.raises(ValueError, match="speculative_model_quantization needs speculative_model"):
        EngineArgs(speculative_model_quantization="W8A16")
    with pytest.raises(ValueError, match="speculative_model_quantization: not a quantization scheme string"):
        EngineArgs(speculative_model="m", speculative_model_quantization="int8")
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "artifact.json").write_text("{}")
    with pytest.raises(ValueError, match="quantization, quantize_lm_head: an artifact runs the task and quantization"):
        EngineArgs(model=str(artifact), quantization="W8A16", quantize_lm_head=True)
    # every model-building command takes the same flags
    parser = cli.build_parser()
    for argv in (["generate", "--quantization", "W8A16", "--kv-cache-dtype", "int8", "-tp", "1"],
                 ["chat", "--speculative-model", "[ngram]", "--num-speculative-tokens", "2"],
                 ["compile", "m", "--quantization", "W8A8", "--auto-bfloat16-cast"],
                 ["build", "m", "out", "-pb", "1,64", "-db", "1,64", "--speculative-model", "[ngram]"],
                 ["serve", "m", "--quantization", "W8A16", "--speculative-model", "[ngram]"]):
        ns = parser.parse_args(argv)
        assert EngineArgs.from_cli_args(ns).llm_kwargs(), argv
    with pytest.raises(ValueError, match="--artifact .*: not an artifact directory"):
        cli._engine_args(parser.parse_args(["generate", "--artifact", str(tmp_path)]))


def test_llm_engine_steps_match_generate(llm, engine_args):
    ref = llm.generate(PROMPTS, greedy())
    eng = LLMEngine(llm, engine_args)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, greedy(output_kind=RequestOutputKind.FINAL_ONLY))
    eng.add_request("gone", "import os", greedy())
    eng.abort_request("gone")
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id != "gone"
            if out.finished:
                done[out.request_id] = out
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == [r.outputs[0].token_ids for r in ref]
    ids = llm.tokenizer("import sys")["input_ids"]
    eng.add_request("tok", {"prompt_token_ids": ids}, greedy(output_kind=RequestOutputKind.FINAL_ONLY))
    while eng.has_unfinished_requests():
        outs = eng.step()
    assert outs[0].outputs[0].token_ids == ref[2].outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt_token_ids"):
        eng.add_request("bad", {"prompt_token_ids": []}, greedy())
    with pytest.raises(TypeError, match="prompt"):
        eng.add_request("bad", 42, greedy())


def test_async_engine_streams_every_kind_and_aborts(llm, engine_args):
    ref = llm.generate(PROMPTS, greedy(max_tokens=16))

    async def main():
        aeng = AsyncLLMEngine(LLMEngine(llm, engine_args))
        done_metrics = []
        aeng.on_request_done.append(done_metrics.append)

        async def collect(prompt, kind, rid):
            outs = [o async for o in aeng.generate(prompt, greedy(max_tokens=16, output_kind=kind), rid)]
            return outs

        tasks = [collect(p, kind, f"{kind.name}-{i}") for i, p in enumerate(PROMPTS)
                 for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY)]

        async def abandoned():  # reads one chunk and walks away: the request must be aborted
            gen = aeng.generate("import sys", greedy(max_tokens=100), "abandoned")
            await gen.__anext__()
            await gen.aclose()

        results = await asyncio.gather(*tasks, abandoned())
        for _ in range(200):
            if not llm.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        assert not llm.engine.has_unfinished_requests() and aeng.num_streams == 0
        assert llm.engine.requests == {}
        aeng.shutdown()
        return results[:-1], done_metrics

    results, metrics = asyncio.run(main())
    for i in range(len(PROMPTS)):
        delta, cum, final = results[3 * i: 3 * i + 3]
        want = ref[i].outputs[0]
        assert sum((o.outputs[0].token_ids for o in delta), []) == want.token_ids
        assert "".join(o.outputs[0].text for o in delta) == want.text
        assert len(final) == 1 and final[0].outputs[0].token_ids == want.token_ids and final[0].finished
        assert cum[-1].outputs[0].text == want.text
        assert all(a.outputs[0].text == b.outputs[0].text[:len(a.outputs[0].text)] for a, b in zip(cum, cum[1:]))
    assert sorted(m.finish_reason for m in metrics).count("abort") == 1
    assert all(m.first_token is not None for m in metrics if m.finish_reason != "abort")


def test_async_engine_best_of_returns_the_n_most_likely(llm, engine_args):
    """best_of > n: which n completions lead changes while they run; the final (and cumulative-at-the-end)
    output is exactly LLM.generate's n best, in its order, not every completion that ever led."""
    params = dict(n=2, best_of=5, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    want = llm.generate(PROMPTS[0], SamplingParams(**params)).outputs

    async def main():
        aeng = AsyncLLMEngine(LLMEngine(llm, engine_args))
        try:
            return [[o async for o in aeng.generate(PROMPTS[0], SamplingParams(**params, output_kind=kind), str(kind))]
                    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE)]
        finally:
            aeng.shutdown()

    final, cumulative = asyncio.run(main())
    for last in (final[-1], cumulative[-1]):
        assert last.finished and [(c.text, c.token_ids) for c in last.outputs] == [(c.text, c.token_ids) for c in want]


def test_slow_consumer_does_not_hold_back_others(llm, engine_args):
    async def main():
        aeng = AsyncLLMEngine(LLMEngine(llm, engine_args))
        # long enough that it cannot finish before its first output is read (40 tokens did once, on a fast host)
        slow = aeng.generate("while True:", greedy(max_tokens=110, ignore_eos=True), "slow")
        first = await slow.__anext__()  # then it stops reading while the others run to completion
        fast = [[o async for o in aeng.generate(p, greedy(max_tokens=20), f"f{i}")] for i, p in enumerate(PROMPTS)]
        steps_for_fast = aeng.steps
        rest = [o async for o in slow]  # everything generated meanwhile arrives merged, in few outputs
        aeng.shutdown()
        return first, fast, rest, steps_for_fast

    first, fast, rest, steps = asyncio.run(main())
    assert not first.finished, len(first.outputs[0].token_ids)
    assert all(f[-1].finished for f in fast)
    tokens = len(first.outputs[0].token_ids) + sum(len(o.outputs[0].token_ids) for o in rest)
    assert rest[-1].finished and len(rest) < tokens - len(first.outputs[0].token_ids)
    assert steps >= 20  # the engine kept stepping while the slow stream was not read


def test_delta_holds_back_a_possible_stop_string(llm):
    full = llm.generate("The class statement", greedy(max_tokens=24)).outputs[0].text
    # a stop string that starts mid-output: deltas must never emit its first characters early
    start = len(full) // 2
    stop = full[start:start + 4]
    want = llm.generate("The class statement", greedy(max_tokens=24, stop=[stop])).outputs[0]
    assert want.finish_reason == "stop" and stop not in want.text

    async def stream():
        return [d async for d in llm.stream_generate("The class statement", greedy(max_tokens=24, stop=[stop]))]

    deltas = asyncio.run(stream())
    assert "".join(deltas) == want.text


def test_stream_generate_yields_every_completion(llm):
    p = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8)
    ref = llm.generate("import sys", p)

    async def stream():
        return [d async for d in llm.stream_generate("import sys", p)]

    text = "".join(asyncio.run(stream()))
    assert text == ref.outputs[0].text + ref.outputs[1].text
    assert ref.outputs[1].text and len(text) > len(ref.outputs[0].text)

    async def best_of():
        return [d async for d in llm.stream_generate("import sys", SamplingParams(n=1, best_of=3, temperature=1.0))]

    with pytest.raises(ValueError, match=r"stream_generate: best_of \(3\) must equal n \(1\)"):
        asyncio.run(best_of())
    assert not llm.engine.requests


def _text(llm, prompt: str, **kw) -> str:
    return llm.generate([prompt], SamplingParams(**kw))[0].outputs[0].text


def test_generation_config_defaults_in_cli_generate(llm, monkeypatch, capsys):
    """``fxcompiler generate`` without sampling flags samples with the model's generation_config.json;
    flags win (the flag/config/default order itself: tests/test_generation_defaults.py)."""
    from fxcompiler import cli

    monkeypatch.setattr(cli, "_make_llm", lambda args: llm)  # this module's model
    assert cli.main(["generate", "-p", PROMPTS[0], "--seed", "11"]) == 0
    assert f"### {PROMPTS[0]}\n{_text(llm, PROMPTS[0], **GEN_DEFAULTS, seed=11)}\n" in capsys.readouterr().out
    assert cli.main(["generate", "-p", PROMPTS[0], "--temperature", "0", "--max-tokens", "5"]) == 0
    greedy5 = _text(llm, PROMPTS[0], **{**GEN_DEFAULTS, "temperature": 0.0, "max_tokens": 5})
    assert f"### {PROMPTS[0]}\n{greedy5}\n" in capsys.readouterr().out


def test_cli_generate_quantized_with_a_speculator(engine_args, monkeypatch, capsys):
    """``fxcompiler generate`` builds what its engine flags say: a W8A16 model decoding with the n-gram
    speculator, or with a W4A16 copy of itself as the draft; the greedy text is that model's plain greedy text
    (speculation is lossless)."""
    from fxcompiler import cli

    built = []
    make = cli._make_llm
    monkeypatch.setattr(cli, "_make_llm", lambda args: built.append(make(args)) or built[-1])
    prompt = "def foo(x): return foo(x) + foo(x) + foo"
    argv = ["generate", "--model", engine_args.model, "--max-seq-len-to-capture", "128", "--cache-dir",
            engine_args.cache_dir, "-pb", "1,64", "-db", "1,128", "--quantization", "W8A16", "-p", prompt,
            "--temperature", "0", "--max-tokens", "10"]
    assert cli.main([*argv, "--speculative-model", "[ngram]", "--num-speculative-tokens", "3"]) == 0
    spec = capsys.readouterr().out
    assert cli.main(argv) == 0
    plain = capsys.readouterr().out
    # a draft model: the target itself, quantized to W4A16 while the draft is built
    assert cli.main([*argv, "--speculative-model", engine_args.model, "--speculative-model-quantization", "W4A16",
                     "--num-speculative-tokens", "2"]) == 0
    drafted = capsys.readouterr().out
    assert built[0].num_speculative_tokens == 3 and built[1].num_speculative_tokens is None
    assert built[2].num_speculative_tokens == 2 and built[2].speculative_llm.quantization["weight"] == "int4"
    assert all(b.quantization is not None and b.quantization["weight"] == "int8" for b in built)
    assert spec == plain == drafted and f"### {prompt}\n" in spec and len(spec) > len(f"### {prompt}\n\n")


def test_generation_config_defaults_in_the_server(llm):
    """A request's unset sampling fields and max_tokens come from generation_config.json; set ones win."""
    from fastapi.testclient import TestClient

    from fxcompiler.serving.api_server import build_app

    # The references first: while the AsyncLLMEngine's thread serves this LLM's engine it also steps (and drops
    # the outputs of) requests that LLM.generate adds to the same engine.
    want_defaults = _text(llm, PROMPTS[0], **GEN_DEFAULTS, seed=5, ignore_eos=True)
    want_set = _text(llm, PROMPTS[0], **{**GEN_DEFAULTS, "temperature": 0.0, "max_tokens": 4}, ignore_eos=True)
    engine = AsyncLLMEngine(LLMEngine(llm))
    assert engine.engine.default_sampling_params() == GEN_DEFAULTS
    try:
        with TestClient(build_app(engine, model_name="m")) as http:
            def complete(**body):
                r = http.post("/v1/completions", json={"prompt": PROMPTS[0], "ignore_eos": True, **body})
                assert r.status_code == 200, r.text
                return r.json()

            out = complete(seed=5)  # every sampling field and max_tokens (6, not 16) from the file
            assert out["usage"]["completion_tokens"] == 6
            assert out["choices"][0]["text"] == want_defaults
            out = complete(temperature=0.0, max_tokens=4)  # what the request sets wins
            assert out["usage"]["completion_tokens"] == 4
            assert out["choices"][0]["text"] == want_set
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "ignore_eos": True, "seed": 1})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
    finally:
        engine.shutdown()


def test_server_chat_template_flag(llm, tmp_path):
    """``serve --chat-template``: chat requests without a template of their own render with it (a file or the
    template inline); a request's ``chat_template`` still wins; a bad flag is refused before anything starts."""
    from fastapi.testclient import TestClient

    from fxcompiler.serving.api_server import build_app, load_chat_template

    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    (tmp_path / "t.jinja").write_text(template)
    assert load_chat_template(str(tmp_path / "t.jinja")) == template == load_chat_template(template)
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="no such file, and not a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")
    messages = [{"role": "user", "content": "import sys"}]
    want = _text(llm, "<user>import sys\n<assistant>", temperature=0.0, max_tokens=5, ignore_eos=True)
    own = "{{ messages[0].content }} again"
    want_own = _text(llm, "import sys again", temperature=0.0, max_tokens=5, ignore_eos=True)
    engine = AsyncLLMEngine(LLMEngine(llm))
    try:
        with TestClient(build_app(engine, model_name="m", chat_template=template)) as http:
            def reply(**body):
                r = http.post("/v1/chat/completions", json={"messages": messages, "temperature": 0.0,
                                                            "max_tokens": 5, "ignore_eos": True, **body})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["message"]["content"]

            assert reply() == want
            assert reply(chat_template=own) == want_own
    finally:
        engine.shutdown()


def test_data_parallel_engine_serves_admits_and_reports_every_replica(llm, engine_args):
    """LLMEngine over dp=2 replicas (the router): admission checks, steps and summed stats."""
    from dataclasses import replace

    ref = llm.generate(PROMPTS, greedy())
    with LLM.from_engine_args(replace(engine_args, data_parallel_size=2)) as dp:
        eng = LLMEngine(dp, replace(engine_args, data_parallel_size=2))
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}", p, greedy(output_kind=RequestOutputKind.FINAL_ONLY))
        with pytest.raises(ValueError, match="prompt_token_ids must be in"):
            eng.add_request("bad", {"prompt_token_ids": [10**6]}, greedy())
        assert eng.stats()["num_waiting"] == len(PROMPTS)
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                done[out.request_id] = out
        assert [done[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == \
            [r.outputs[0].token_ids for r in ref]
        assert min(dp.engine.routed) >= 2, dp.engine.routed
        st = eng.stats()
        assert st["generation_tokens"] == sum(len(d.outputs[0].token_ids) for d in done.values())
        assert st["num_running"] == st["num_waiting"] == 0 and st["kv_cache_usage"] == 0.0
