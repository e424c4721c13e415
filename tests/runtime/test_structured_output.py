"""Structured output: guided decoding (JSON schema, json_object, regex, choice, grammar) through LLM.generate."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from fxcompiler import GuidedDecodingParams, LLM, SamplingParams
from runtime.structured_output import mask_logits
from tests.serving.tiny_chat_model import save_tiny_chat_model

pytestmark = pytest.mark.slow

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["color", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}, "label": {"type": ["string", "null"], "maxLength": 4}},
     "required": ["point", "label"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny_chat_model(tmp_path_factory.mktemp("tinyso") / "model")
    with LLM(str(path), max_seq_len_to_capture=128, cache_dir=str(tmp_path_factory.mktemp("c")),
             bucket_config=_buckets()) as llm:
        yield llm


def _buckets():
    from fxcompiler.config import ManualBucketConfig

    return ManualBucketConfig([(1, 64), (4, 64)], [(1, 128), (16, 128)])


def test_fifty_objects_for_five_schemas_parse_and_validate(llm):
    prompts, params = [], []
    for schema in SCHEMAS:
        for seed in range(10):
            prompts.append("Answer in JSON:")
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=80,
                                         guided_decoding=GuidedDecodingParams(json=schema)))
    outs = llm.generate(prompts, params)
    assert len(outs) == 50
    for i, out in enumerate(outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (i, c.text)
        obj = json.loads(c.text)
        jsonschema.validate(obj, SCHEMAS[i // 10])


def test_regex_choice_grammar_json_object_and_untouched_rows(llm):
    plain = llm.generate(["import sys", "while True:"], SamplingParams(temperature=0.0, max_tokens=10))
    kinds = [GuidedDecodingParams(regex=r"[0-9]{3}-[a-z]{2}"), GuidedDecodingParams(choice=["yes", "no", "maybe"]),
             GuidedDecodingParams(grammar='start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9]/'),
             GuidedDecodingParams(json_object=True)]
    prompts = ["import sys"] + ["Say:"] * 4 * 2 + ["while True:"]
    params = [SamplingParams(temperature=0.0, max_tokens=10)]
    for g in kinds:
        params += [SamplingParams(temperature=0.0, max_tokens=60, guided_decoding=g),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=60, guided_decoding=g)]
    params.append(SamplingParams(temperature=0.0, max_tokens=10))
    outs = llm.generate(prompts, params)
    # unconstrained greedy rows in a batch with constrained ones equal their plain runs
    assert outs[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert outs[-1].outputs[0].token_ids == plain[1].outputs[0].token_ids
    texts = [o.outputs[0].text for o in outs[1:-1]]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs[1:7]), texts
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", t) for t in texts[0:2]), texts
    assert all(t in ("yes", "no", "maybe") for t in texts[2:4]), texts
    assert all(re.fullmatch(r"\([1-9](\+[1-9])*\)", t) for t in texts[4:6]), texts
    # json_object: any object (strings unbounded, so a random model may not close it in max_tokens):
    # every token was one the grammar allowed, and a finished output parses as an object
    for out in outs[7:9]:
        c = out.outputs[0]
        assert c.text.startswith("{") and c.finish_reason in ("stop", "length")
        state = llm.engine.grammars().new_state(kinds[3])
        for t in c.token_ids:
            state.accept(t)
        assert not state.matcher.is_error(), c.text
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
    # the constraint changes what an unconstrained greedy run says
    assert texts[0] != llm.generate("Say:", SamplingParams(temperature=0.0, max_tokens=6)).outputs[0].text


def test_bad_constraints_are_refused_at_admission(llm):
    for g, match in ((GuidedDecodingParams(json={"type": "frob"}), "json"),
                     (GuidedDecodingParams(regex="[unclosed"), "regex"),
                     (GuidedDecodingParams(grammar="start: undefined_rule"), "grammar")):
        with pytest.raises(ValueError, match=f"invalid guided_decoding {match}"):
            llm.generate("x", SamplingParams(max_tokens=4, guided_decoding=g))
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(regex="a", choice=["a"])
    with pytest.raises(TypeError, match="choice"):
        GuidedDecodingParams(choice=[])
    with pytest.raises(NotImplementedError, match="beam"):
        SamplingParams(use_beam_search=True, best_of=2, n=1, temperature=0.0,
                       guided_decoding=GuidedDecodingParams(regex="a"))
    assert not llm.engine.requests  # nothing was left behind


def test_mask_touches_only_constrained_rows(llm):
    class Row:
        def __init__(self, grammar):
            self.grammar = grammar

    state = llm.engine.grammars().new_state(GuidedDecodingParams(choice=["yes", "no"]))
    vocab = llm.engine.vocab_size
    logits = torch.randn(3, vocab)
    out = mask_logits(logits, [Row(None), Row(state), Row(None)])
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert allowed and len(allowed) < vocab
    assert all(llm.tokenizer.decode([t]) and ("yes".startswith(llm.tokenizer.decode([t]))
                                               or "no".startswith(llm.tokenizer.decode([t]))) for t in allowed)
    assert mask_logits(logits, [Row(None)] * 3) is logits  # no constrained row: no copy


def test_bitmask_expansion_matches_the_bit_arithmetic():
    from fxcompiler.ops.sampling import unpack_token_bitmask

    g = torch.Generator().manual_seed(0)
    for vocab in (1, 31, 32, 33, 95, 1000):
        words = (vocab + 31) // 32
        bitmask = torch.randint(-(1 << 31), (1 << 31) - 1, (4, words), dtype=torch.int64, generator=g).to(torch.int32)
        bitmask[0, -1] = -(1 << 31)  # the sign bit is token 32 * w + 31
        ref = [[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)] for r in range(4)]
        assert unpack_token_bitmask(bitmask, vocab).tolist() == ref
