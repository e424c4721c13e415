"""End to end on the embedded default model (SmolLM2-135M-Instruct, real weights, fp32)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from fxcompiler import LLM, SamplingParams
from fxcompiler.models.loader import model_directory
from fxcompiler.models.sources import DEFAULT_MODEL_ID, resolve_model_source

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "List three colours:",
    "Water boils at",
    "The theory of relativity, proposed by Albert Einstein in the early twentieth century, changed our "
    "understanding of space and time. In simple terms, it says that",
    "Hello",
    "Translate to French: I like apples.",
]
NEW_TOKENS = 64
TIE = 1e-4


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL_ID)


@pytest.fixture(scope="module")
def hf_model(llm):
    from transformers import AutoModelForCausalLM

    path = model_directory(resolve_model_source(DEFAULT_MODEL_ID), llm.cache_dir)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


_HF_REFERENCE: dict[tuple[tuple[int, ...], int], object] = {}  # (prompt ids, new tokens) -> generate output


def _check_against_hf(hf_model, prompt_ids: list[int], ours: list[int]) -> None:
    """Identical tokens, except that a divergence is allowed at a near-tie of transformers' top-2 logits."""
    key = (tuple(prompt_ids), len(ours))
    if key not in _HF_REFERENCE:
        with torch.no_grad():
            _HF_REFERENCE[key] = hf_model.generate(
                torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=len(ours), eos_token_id=None,
                output_scores=True, return_dict_in_generate=True, pad_token_id=hf_model.config.eos_token_id)
    out = _HF_REFERENCE[key]
    ref = out.sequences[0, len(prompt_ids):].tolist()
    assert len(ref) == len(ours), "transformers stopped early: EOS was not disabled"
    for step, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = out.scores[step][0].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < TIE, f"diverged at step {step} ({a} vs {b}) where transformers' top-2 gap is {gap}"
            return
    assert ours == ref


def test_greedy_parity_with_transformers(llm, hf_model):
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp)
    assert [o.prompt for o in outs] == PROMPTS
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.outputs[0].token_ids) == NEW_TOKENS
        _check_against_hf(hf_model, out.prompt_token_ids, out.outputs[0].token_ids)


@pytest.mark.parametrize("kind", ["dfg", "edf"])
def test_greedy_parity_of_the_other_supertask_kinds(kind, llm, hf_model):
    """dfg (ONNX blobs) and edf (AOTInductor packages calling the fxc kernels) generate what
    transformers generates, under the same tie rule."""
    other = LLM(DEFAULT_MODEL_ID, comp_supertask_kind=kind, num_compile_workers=2)
    assert {t.kind.value for p in other.pipelines for _, t in p.compute_supertasks()} == {kind}
    outs = other.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for out in outs:
        _check_against_hf(hf_model, out.prompt_token_ids, out.outputs[0].token_ids)


def test_chat_answers_the_question(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=30))
    assert len(out) == 1
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"
    assert out[0].outputs[0].token_ids[-1] in llm._eos


def test_chat_many_conversations_and_continue_final_message(llm):
    convs = [[{"role": "user", "content": "Say hi."}],
             [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two,"}]]
    outs = llm.chat(convs[:1], SamplingParams(temperature=0, max_tokens=8))
    assert len(outs) == 1
    cont = llm.chat([convs[1]], SamplingParams(temperature=0, max_tokens=8), add_generation_prompt=False,
                    continue_final_message=True)
    assert "three" in cont[0].outputs[0].text.lower()
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(convs[1], continue_final_message=True, add_generation_prompt=True)


def test_stream_generate_matches_generate(llm):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def collect():
        return [d async for d in llm.stream_generate("The recipe for a good café au lait ☕ is", sp)]

    deltas = asyncio.run(collect())
    full = llm.generate("The recipe for a good café au lait ☕ is", sp).outputs[0].text
    assert len(deltas) > 5
    assert "".join(deltas) == full
    assert all("\ufffd" not in d for d in deltas)


def test_many_prompts_finish_and_free_every_block(llm):
    prompts = [f"Item {i}: the number {i} squared is" for i in range(256)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert len(outs) == 256 and all(o.finished for o in outs)
    assert [o.prompt for o in outs] == prompts
    blocks = llm.engine.scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_usable_blocks
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


def test_seeded_sampling_is_reproducible(llm):
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    a = llm.generate("Tell me a story", sp).outputs[0].token_ids
    b = llm.generate(["Tell me a story", "Other prompt", "x"], [sp, SamplingParams(max_tokens=5),
                                                               SamplingParams(max_tokens=3)])[0]
    assert a == b.outputs[0].token_ids


def test_prompt_token_ids_batch_encoding(llm):
    enc = llm.tokenizer(["Hello there", "The sky is"], padding=True, return_tensors="pt")
    outs = llm.generate(["Hello there", "The sky is"], SamplingParams(temperature=0, max_tokens=5),
                        prompt_token_ids=enc)
    plain = llm.generate(["Hello there", "The sky is"], SamplingParams(temperature=0, max_tokens=5))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_bad_inputs_raise_specific_errors(llm):
    with pytest.raises(ValueError, match="empty list"):
        llm.generate([])
    with pytest.raises(ValueError, match="maximum input context length"):
        llm.generate("word " * 3000, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-2)
    with pytest.raises(TypeError, match="prompts"):
        llm.generate(123)
    with pytest.raises(ValueError, match="prompts\\[0\\] is empty"):
        llm.generate("")


def test_stop_strings_stop_token_ids_and_logprobs(llm):
    base = llm.generate("Count: one, two, three, four, five,", SamplingParams(temperature=0, max_tokens=20,
                                                                             ignore_eos=True))
    text = base.outputs[0].text
    assert "," in text
    stop = llm.generate("Count: one, two, three, four, five,",
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[","]))
    assert stop.outputs[0].finish_reason == "stop" and stop.outputs[0].stop_reason == ","
    assert stop.outputs[0].text == text[: text.index(",")]
    first = base.outputs[0].token_ids[2]
    by_id = llm.generate("Count: one, two, three, four, five,",
                         SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[first]))
    assert by_id.outputs[0].token_ids == base.outputs[0].token_ids[:3]
    assert by_id.outputs[0].stop_reason == first
    lp = llm.generate("Count: one, two,", SamplingParams(temperature=0, max_tokens=4, logprobs=3))
    steps = lp.outputs[0].logprobs
    assert len(steps) == 4
    for tok, entry in zip(lp.outputs[0].token_ids, steps):
        assert tok in entry and len(entry) <= 4
        assert max(entry.values(), key=lambda l: l.logprob).logprob == entry[tok].logprob  # greedy = top-1
    assert abs(sum(e[t].logprob for t, e in zip(lp.outputs[0].token_ids, steps))
               - lp.outputs[0].cumulative_logprob) < 1e-4
