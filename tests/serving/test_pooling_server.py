"""Serving encoder models: ``/v1/embeddings`` (through the ``openai`` client, float and base64), ``/v1/score``,
``/v1/rerank``, ``/tokenize`` / ``/detokenize``, OpenAI error bodies, against ``LLM.embed`` / ``LLM.score`` of the
same model in process; and ``fxcompiler serve`` on an embedding checkpoint as a subprocess."""
from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

import tests.test_encoder_tasks as encoders
from fxcompiler.encoder_tasks import PoolingParams
from fxcompiler.serving.pooling_server import build_pooling_app

from .server_process import start_server

pytestmark = pytest.mark.slow

TEXTS = ["the cat sat on the mat", "a dog ran to the park", "fish"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooling")
    built = {name: encoders._build(root, name) for name in ("bert_embed", "bert_cross_encoder")}
    yield {name: b.llm for name, b in built.items()}, root
    for b in built.values():
        b.llm.shutdown()


@pytest.fixture(scope="module")
def emb(models):
    llm = models[0]["bert_embed"]
    with TestClient(build_pooling_app(llm, model_name="emb")) as http:
        yield llm, http


@pytest.fixture(scope="module")
def cross(models):
    llm = models[0]["bert_cross_encoder"]
    with TestClient(build_pooling_app(llm, model_name="cross")) as http:
        yield llm, http


def _error(r: httpx.Response, status: int, param: str | None, text: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param and text in err["message"], err


def test_embeddings_through_the_openai_client(emb):
    llm, http = emb
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    want = [o.outputs.embedding for o in llm.embed(TEXTS)]
    got = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    assert [d.index for d in got.data] == [0, 1, 2] and [d.embedding for d in got.data] == want
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in llm.embed(TEXTS)) > 0
    b64 = client.embeddings.create(model="emb", input=TEXTS)  # the client asks for base64 and decodes it
    for d, w in zip(b64.data, want):
        assert np.array_equal(np.asarray(d.embedding, dtype=np.float32), np.asarray(w, dtype=np.float32))
    ids = [[5, 6, 7], [8, 9]]
    r = http.post("/v1/embeddings", json={"input": ids, "dimensions": 8, "normalize": False})
    want_ids = llm.embed([{"prompt_token_ids": t} for t in ids], PoolingParams(dimensions=8, normalize=False))
    assert r.status_code == 200, r.text
    assert [d["embedding"] for d in r.json()["data"]] == [o.outputs.embedding for o in want_ids]
    assert len(r.json()["data"][0]["embedding"]) == 8 and r.json()["usage"]["prompt_tokens"] == 5
    one = http.post("/v1/embeddings", json={"input": [5, 6, 7]}).json()  # one token-id prompt
    assert one["data"][0]["embedding"] == llm.embed([{"prompt_token_ids": [5, 6, 7]}])[0].outputs.embedding


def test_score_and_rerank(emb, cross):
    for llm, http in (cross, emb):  # a cross-encoder's relevance; an embedding model's cosine similarity
        want = [o.outputs.score for o in llm.score(TEXTS[0], TEXTS)]
        r = http.post("/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS})
        assert r.status_code == 200, r.text
        assert [d["score"] for d in r.json()["data"]] == want and [d["index"] for d in r.json()["data"]] == [0, 1, 2]
        pairs = http.post("/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()
        assert [d["score"] for d in pairs["data"]] == [o.outputs.score for o in llm.score(TEXTS[:2], TEXTS[1:])]
        r = http.post("/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS, "top_n": 2})
        assert r.status_code == 200, r.text
        order = sorted(range(3), key=lambda i: -want[i])[:2]
        assert [x["index"] for x in r.json()["results"]] == order
        assert [x["relevance_score"] for x in r.json()["results"]] == [want[i] for i in order]
        assert [x["document"]["text"] for x in r.json()["results"]] == [TEXTS[i] for i in order]
        bare = http.post("/rerank", json={"query": TEXTS[0], "documents": TEXTS, "return_documents": False}).json()
        assert len(bare["results"]) == 3 and "document" not in bare["results"][0]


def test_tokenize_and_detokenize(emb):
    llm, http = emb
    r = http.post("/tokenize", json={"prompt": TEXTS[0]})
    ids = llm.tokenizer.encode(TEXTS[0])
    assert r.json() == {"count": len(ids), "max_model_len": llm.max_seq_len_to_capture, "tokens": ids}
    plain = http.post("/tokenize", json={"prompt": TEXTS[0], "add_special_tokens": False}).json()["tokens"]
    assert plain == llm.tokenizer.encode(TEXTS[0], add_special_tokens=False) != ids
    assert http.post("/detokenize", json={"tokens": plain}).json() == {"prompt": llm.tokenizer.decode(plain)}
    _error(http.post("/detokenize", json={"tokens": [10 ** 6]}), 400, "tokens", "outside the vocabulary")
    _error(http.post("/tokenize", json={}), 400, "prompt", "give either prompt or messages")


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(emb, cross):
    llm, http = emb
    _error(http.post("/v1/embeddings", json={"input": []}), 400, "input", "must not be empty")
    _error(http.post("/v1/embeddings", json={"input": [[5], []]}), 400, "input", "must not be empty")
    _error(http.post("/v1/embeddings", json={"input": [[5] * 65]}), 400, "input", "has 65 tokens, more than")
    _error(http.post("/v1/embeddings", json={"input": [10 ** 6]}), 400, "input", "outside the vocabulary")
    _error(http.post("/v1/embeddings", json={"input": "x", "dimensions": 10 ** 4}), 400, "input", "exceeds the hidden")
    _error(http.post("/v1/embeddings", json={"input": "x", "encoding_format": "int8"}), 400, "encoding_format", "")
    _error(http.post("/v1/embeddings", json={"input": "x", "model": "other"}), 404, "model", "does not exist")
    _error(http.post("/v1/completions", json={"prompt": "x"}), 400, "model", "does not support the Completions API")
    _error(http.post("/v1/chat/completions", json={"messages": []}), 400, "model", "use /v1/embeddings")
    _error(http.post("/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS}), 400, "text_1", "give one text_1")
    _error(cross[1].post("/v1/embeddings", json={"input": "x"}), 400, "model", "is a cross-encoder")
    _error(cross[1].post("/v1/rerank", json={"query": "x", "documents": []}), 400, "documents", "")
    many = ["x"] * 2049
    _error(http.post("/v1/embeddings", json={"input": many}), 400, "input", "2049 items, at most 2048")
    _error(http.post("/v1/embeddings", json={"input": [[5]] * 2049}), 400, "input", "at most 2048")
    _error(http.post("/v1/score", json={"text_1": "x", "text_2": many}), 400, "text_2", "at most 2048")
    _error(cross[1].post("/v1/rerank", json={"query": "x", "documents": many}), 400, "documents", "at most 2048")
    m = http.get("/metrics").text
    assert 'fxcompiler:request_success_total{finished_reason="error",model_name="emb"}' in m
    r = http.post("/v1/embeddings", json={"input": TEXTS[1]})  # still serving
    assert r.status_code == 200 and r.json()["data"][0]["embedding"] == llm.embed(TEXTS[1])[0].outputs.embedding
    assert http.get("/health").status_code == 200 and http.get("/v1/models").json()["data"][0]["id"] == "emb"


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A tiny BertForSequenceClassification with three labels (random weights, float64)."""
    import torch
    from transformers import BertForSequenceClassification

    from fxcompiler import LLM
    from fxcompiler.encoder_zoo import encoder_config

    cfg = encoder_config("bert_cross_encoder")
    cfg.num_labels, cfg.id2label, cfg.label2id = 3, {0: "neg", 1: "neu", 2: "pos"}, {"neg": 0, "neu": 1, "pos": 2}
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("classifier") / "bert3"
    model.save_pretrained(path)
    encoders._tokenizer(path, with_token_types=True).save_pretrained(path)
    llm = LLM(str(path), dtype="float64", cache_dir=None)
    yield llm, model
    llm.shutdown()


def test_classify_against_transformers(classifier, emb):
    """LLM.classify: softmax over the labels of transformers' logits (float64); /classify serves it with the
    checkpoint's label names; score() on a three-label model points at classify."""
    import torch

    llm, ref = classifier
    outs = llm.classify(TEXTS + [{"prompt_token_ids": [2, 9, 10, 3]}])
    for o, text in zip(outs, TEXTS):
        enc = llm.tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            want = torch.softmax(ref(**enc).logits[0], dim=-1).tolist()
        assert o.outputs.num_classes == 3 and o.outputs.probs == pytest.approx(want, abs=1e-9)
        assert o.prompt_token_ids == enc["input_ids"][0].tolist()
    with pytest.raises(ValueError, match=r"num_labels=3 \(LLM.classify gives its class probabilities\)"):
        llm.score("a", "b")
    with pytest.raises(ValueError, match="LLM.classify needs an LLM built with task_type='score'"):
        emb[0].classify(TEXTS)
    with TestClient(build_pooling_app(llm, model_name="cls")) as http:
        r = http.post("/classify", json={"input": TEXTS})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["probs"] for d in data] == [o.outputs.probs for o in llm.classify(TEXTS)]  # the same batch
        assert [d["label"] for d in data] == [["neg", "neu", "pos"][max(range(3), key=d["probs"].__getitem__)]
                                              for d in data]
        assert all(d["num_classes"] == 3 for d in data) and r.json()["usage"]["prompt_tokens"] > 0
        _error(http.post("/classify", json={"input": []}), 400, "input", "must not be empty")
        _error(http.post("/v1/completions", json={"prompt": "x"}), 400, "model", "/classify")
    _error(emb[1].post("/classify", json={"input": "x"}), 400, "model", "is an embedding model")


def test_serve_an_embedding_checkpoint(models, tmp_path):
    """``fxcompiler serve`` builds an encoder checkpoint and serves it through these routes; SIGTERM exits 0."""
    llms, root = models
    srv = start_server(root / "bert_embed", tmp_path, served_name="emb", base_flags=["--threads", "1"],
                       extra_flags=["--dtype", "float64"])
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
        want = [o.outputs.embedding for o in llms["bert_embed"].embed(TEXTS)]
        assert np.allclose([d.embedding for d in got.data], want, atol=1e-12, rtol=0)
        r = httpx.post(srv.base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 400 and "/v1/embeddings" in r.json()["error"]["message"]
        # concurrent requests (run one at a time by the server), good and bad mixed: each gets its own answer
        from concurrent.futures import ThreadPoolExecutor

        def one(k: int):
            body = {"input": [10 ** 6]} if k % 3 == 0 else {"input": TEXTS[k % 3], "encoding_format": "float"}
            return k, httpx.post(srv.base_url + "/v1/embeddings", json=body, timeout=120)

        with ThreadPoolExecutor(8) as pool:
            for k, r in pool.map(one, range(12)):
                if k % 3 == 0:
                    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
                else:
                    assert np.allclose(r.json()["data"][0]["embedding"], want[k % 3], atol=1e-12, rtol=0)
        assert httpx.get(srv.base_url + "/health").status_code == 200
    finally:
        assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log_path.read_text(errors="replace"), srv.log()
