"""Encoder task types against transformers: BERT question answering (``bert_forward``), embeddings
(``embed``: CLS / MEAN / LAST pooling, normalisation) and scores (``score``: cross-encoders, cosine of
embeddings), on random tiny configs of transformers' own classes in float64, through capture → default
passes → blockwise fx supertasks, prompts of different lengths batched into padded buckets.

The parity tests are parametrised over ``fxcompiler.encoder_zoo.ENCODER_ZOO`` — the list the support
table's parity column is rendered from — so the table names exactly the checks run here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fxcompiler import LLM
from fxcompiler.encoder_tasks import EMBED, QA, SCORE, PoolerConfig, PoolingParams
from fxcompiler.encoder_zoo import ENCODER_ZOO, TOLERANCE, encoder_config, encoder_names

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"
WORDS = ("the cat sat on mat where is dog ran to park what did a eat fish who red blue house in garden "
         "big small tree under near").split()
QUESTIONS = ["where is the cat", "what did the dog eat", "who ran to the park", "where is the red house",
             "what is big", "who sat"]
CONTEXTS = ["the cat sat on the mat", "the dog did eat a fish in the garden near the big tree",
            "a small dog ran to the park", "the red house is near the park under a big blue tree " * 2,
            "the tree is big", "the cat sat on the red mat in the house near the garden"]
TEXTS = ["the cat", "a dog ran to the park", "the red house is in the garden", "fish",
         "where is the big blue tree near the small house under the tree", "who sat on the mat"]


def _tokenizer(path: Path, with_token_types: bool):
    from transformers import BertTokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    vocab += [c for c in "abcdefghijklmnopqrstuvwxyz"] + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    vocab = list(dict.fromkeys(vocab))  # ids 0..n-1, each once
    names = ["input_ids", "token_type_ids", "attention_mask"] if with_token_types else ["input_ids", "attention_mask"]
    return BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, model_input_names=names)


@dataclass
class Built:
    name: str
    llm: LLM
    ref: torch.nn.Module
    tok: object


def _classes(name: str):
    from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForQuestionAnswering,
                              AutoModelForSequenceClassification)

    task = ENCODER_ZOO[name].task
    if name == "qwen2_embed":  # a causal LM's checkpoint served as an embedding model (its base model)
        return AutoModelForCausalLM, AutoModel
    cls = {QA: AutoModelForQuestionAnswering, SCORE: AutoModelForSequenceClassification, EMBED: AutoModel}[task]
    return cls, cls


def _build(root: Path, name: str) -> Built:
    case = ENCODER_ZOO[name]
    save_cls, ref_cls = _classes(name)
    torch.manual_seed(0)
    model = save_cls.from_config(encoder_config(name), dtype=torch.float32)
    with torch.no_grad():  # spread the weights: logits of order 1, so 1e-5 is a real bound
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    path = root / name
    model.save_pretrained(path)
    tok = _tokenizer(path, with_token_types=name.startswith("bert"))
    tok.save_pretrained(path)
    if name == "bert_embed":  # a sentence-transformers checkpoint: MEAN pooling, then Normalize
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    task_type = "embed" if name == "qwen2_embed" else None  # encoders: inferred from the class, as furiosa does
    llm = LLM(str(path), task_type=task_type, dtype="float64", cache_dir=None)
    assert llm.task == case.task
    assert {t.kind.value for p in llm.pipelines for _, t in p.compute_supertasks()} == {"fx"}
    assert llm.pipelines[0].metadata["blockwise"]["unique_block_blobs"] == 1  # both layers run one shared blob
    ref = ref_cls.from_pretrained(str(path), dtype=torch.float64).eval()
    return Built(name, llm, ref, llm.tokenizer)  # the reference sees the token ids the LLM tokenises


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            cache[name] = _build(root, name)
        return cache[name]

    yield get
    for b in cache.values():
        b.llm.shutdown()


def _max_abs(got, want) -> float:
    return float((torch.as_tensor(got, dtype=torch.float64) - want).abs().max())


def _hidden(b: Built, text: str) -> torch.Tensor:
    with torch.no_grad():
        return b.ref(**b.tok(text, return_tensors="pt")).last_hidden_state[0]


_POOL = {"CLS": lambda h: h[0], "MEAN": lambda h: h.mean(0), "LAST": lambda h: h[-1]}


def _steps(b: Built) -> int:
    return b.llm._encoder.runner.steps


def check_qa_logits(b: Built):
    before = _steps(b)
    outs = b.llm.bert_forward(QUESTIONS, CONTEXTS)
    assert _steps(b) - before < len(QUESTIONS)  # batched into padded buckets, not one run per pair
    for q, c, out in zip(QUESTIONS, CONTEXTS, outs):
        enc = b.tok(q, c, return_tensors="pt")
        with torch.no_grad():
            ref = b.ref(**enc)
        assert out.prompt_token_ids == enc["input_ids"][0].tolist()
        assert _max_abs(out.answer.start_logits, ref.start_logits[0]) <= TOLERANCE
        assert _max_abs(out.answer.end_logits, ref.end_logits[0]) <= TOLERANCE


def _reference_span(start, end, ids, types, sep, max_len=30):
    best, where = float("-inf"), (0, 0)
    context = [j for j, (i, t) in enumerate(zip(ids, types)) if t == 1 and i != sep]  # the context's word pieces
    for i in context:
        for j in context:
            if i <= j < i + max_len and float(start[i] + end[j]) > best:
                best, where = float(start[i] + end[j]), (i, j)
    return where


def check_qa_span(b: Built):
    outs = b.llm.bert_forward(QUESTIONS, CONTEXTS)
    for q, c, out in zip(QUESTIONS, CONTEXTS, outs):
        enc = b.tok(q, c, return_tensors="pt")
        with torch.no_grad():
            ref = b.ref(**enc)
        ids = enc["input_ids"][0].tolist()
        s, e = _reference_span(ref.start_logits[0], ref.end_logits[0], ids, enc["token_type_ids"][0].tolist(),
                               b.tok.sep_token_id)
        assert (out.answer.start, out.answer.end) == (s, e)
        assert out.outputs[0].token_ids == ids[s:e + 1]
        assert out.outputs[0].text == b.tok.decode(ids[s:e + 1], skip_special_tokens=True)
        assert out.prompt == q and out.finished
    single = b.llm.bert_forward(QUESTIONS[0], CONTEXTS[0])  # a str pair gives one RequestOutput
    assert single.outputs[0].token_ids == outs[0].outputs[0].token_ids


def _check_pool(kind):
    def check(b: Built):
        outs = b.llm.embed(TEXTS, PoolingParams(normalize=False, pooling_type=kind))
        for text, out in zip(TEXTS, outs):
            want = _POOL[kind](_hidden(b, text))
            assert len(out.outputs.embedding) == want.shape[0]
            assert _max_abs(out.outputs.embedding, want) <= TOLERANCE, (kind, text)
            assert out.prompt_token_ids == b.tok(text)["input_ids"]
    return check


def check_normalize(b: Built):
    default = b.llm._encoder.pooler.pooling_type  # the checkpoint's (sentence-transformers: MEAN), normalised
    outs = b.llm.embed(TEXTS)
    cut = b.llm.embed(TEXTS[:2], PoolingParams(dimensions=8))  # Matryoshka: truncate, then normalise
    for text, out in zip(TEXTS, outs):
        want = _POOL[default](_hidden(b, text))
        assert _max_abs(out.outputs.embedding, want / want.norm()) <= TOLERANCE
    for text, out in zip(TEXTS, cut):
        want = _POOL[default](_hidden(b, text))[:8]
        assert _max_abs(out.outputs.embedding, want / want.norm()) <= TOLERANCE


def check_st_pooling(b: Built):
    assert (b.llm._encoder.pooler.pooling_type, b.llm._encoder.pooler.normalize) == ("MEAN", True)
    for text, out in zip(TEXTS, b.llm.embed(TEXTS)):
        want = _hidden(b, text).mean(0)
        assert _max_abs(out.outputs.embedding, want / want.norm()) <= TOLERANCE


def check_score_cosine(b: Built):
    default = b.llm._encoder.pooler.pooling_type
    outs = b.llm.score(TEXTS[0], TEXTS[1:])  # one text_1 against every text_2
    left = _POOL[default](_hidden(b, TEXTS[0]))
    for text, out in zip(TEXTS[1:], outs):
        want = torch.nn.functional.cosine_similarity(left, _POOL[default](_hidden(b, text)), dim=-1)
        assert abs(out.outputs.score - float(want)) <= TOLERANCE


def check_score_cross(b: Built):
    outs = b.llm.score(QUESTIONS, CONTEXTS)  # pairs, one to one
    for q, c, out in zip(QUESTIONS, CONTEXTS, outs):
        with torch.no_grad():
            logit = b.ref(**b.tok(q, c, return_tensors="pt")).logits[0, 0]
        assert abs(out.outputs.score - float(torch.sigmoid(logit))) <= TOLERANCE  # vLLM's default activation
    one = b.llm.score(QUESTIONS[1], CONTEXTS[:3])
    assert [o.outputs.score for o in one][1] == pytest.approx(outs[1].outputs.score, abs=1e-12)


CHECKS = {"qa_logits": check_qa_logits, "qa_span": check_qa_span, "pool_cls": _check_pool("CLS"),
          "pool_mean": _check_pool("MEAN"), "pool_last": _check_pool("LAST"), "normalize": check_normalize,
          "st_pooling": check_st_pooling, "score_cosine": check_score_cosine, "score_cross": check_score_cross}
CASES = [(name, check) for name in encoder_names() for check in ENCODER_ZOO[name].checks]


@pytest.mark.parametrize("name, check", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_parity_with_transformers(built, name, check):
    CHECKS[check](built(name))


# -- errors ------------------------------------------------------------------------------------------------
def test_unknown_pooling_is_refused():
    with pytest.raises(ValueError, match=r"unknown pooling type 'max'; expected one of \['CLS', 'MEAN', 'LAST'\]"):
        PoolingParams(pooling_type="max")
    with pytest.raises(ValueError, match="unknown pooling type 'attention'"):
        PoolerConfig(pooling_type="attention")


def test_too_long_requests_name_the_lengths(built):
    qa = built("bert_qa").llm
    with pytest.raises(ValueError, match=r"request 0 has \d+ tokens, more than the model's max_position_embeddings "
                                         r"allows \(64 tokens; max_position_embeddings=64\)"):
        qa.bert_forward("where is the cat", " ".join(["cat"] * 70))
    emb = built("bert_embed").llm
    with pytest.raises(ValueError, match=r"request 1 has 65 tokens, more than the model's max_position_embeddings"):
        emb.embed([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5] * 65}])


def test_methods_of_another_task_are_refused(built):
    qa, emb = built("bert_qa").llm, built("bert_embed").llm
    with pytest.raises(ValueError, match=r"need a text-generation model; this LLM's task is 'question-answering'"):
        qa.generate("where is the cat")
    with pytest.raises(ValueError, match=r"LLM.bert_forward needs an LLM built with task_type='question-answering'"
                                         r".*this LLM's task is 'embed'"):
        emb.bert_forward("where is the cat", "the cat sat")
    with pytest.raises(ValueError, match=r"LLM.embed needs an LLM built with task_type='embed'"):
        qa.embed("the cat")
    with pytest.raises(ValueError, match=r"LLM.score needs .*this LLM's task is 'question-answering'"):
        qa.score("a", "b")
    decoder = LLM.__new__(LLM)  # a text-generation LLM (nothing built is needed to refuse)
    with pytest.raises(ValueError, match=r"LLM.embed needs .*this LLM's task is 'text-generation'"):
        decoder.embed(["a"])


def test_task_arguments_are_checked(tmp_path):
    from transformers import BertConfig

    with pytest.raises(ValueError, match=r"task_type='translation' is not a task fxcompiler knows"):
        LLM(str(tmp_path), task_type="translation")
    BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
               architectures=["BertModel"]).save_pretrained(tmp_path / "bert")
    with pytest.raises(NotImplementedError, match=r"^tensor_parallel_size=2 with task 'embed': encoder tasks"):
        LLM(str(tmp_path / "bert"), tensor_parallel_size=2, cache_dir=None)
    with pytest.raises(ValueError, match=r"override_pooler_config is for embedding models"):
        LLM(str(tmp_path / "bert"), task_type="score", override_pooler_config=PoolerConfig("MEAN"), cache_dir=None)


def test_docs_encoder_table_is_these_builds(built):
    """docs/models.md's encoder table: the parity column lists the checks above, the fusion and kernel columns
    are those of the builds the checks ran on (regenerate: fxcompiler models --write docs/models.md)."""
    from fxcompiler.support import ENCODER_BEGIN, ENCODER_END, encoder_report, extract, render_encoders

    reports = [encoder_report(n, built(n).llm._build.context, built(n).llm._build.graph_module)
               for n in encoder_names()]
    assert extract(DOC.read_text(), ENCODER_BEGIN, ENCODER_END) == render_encoders(reports), \
        "docs/models.md is stale: run `python -m fxcompiler.cli models --write docs/models.md`"
