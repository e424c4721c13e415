"""``fxcompiler serve`` for encoder models: OpenAI's ``/v1/embeddings`` (``task_type`` embed), vLLM's
``/v1/score`` and Jina/Cohere-style ``/v1/rerank`` (a cross-encoder, ``task_type`` score, or the cosine of an
embedding model's vectors) and vLLM's ``/classify`` (a sequence classifier's probabilities), on
:meth:`LLM.embed` / :meth:`LLM.score` / :meth:`LLM.classify`.

An encoder request runs once (no decode steps), so requests run one at a time on a worker thread, each batched
by the encoder runner into its buckets; the event loop stays free for health checks and new connections.
Question-answering models (furiosa's ``bert_forward``) have no OpenAI route and are refused.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from typing import Any, Callable, Literal

import numpy as np
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from ..encoder_tasks import EMBED, QA, SCORE, PoolingParams
from ..sampling_params import limit
from .app_base import add_status_routes, base_app
from .metrics import PoolingMetrics
from .protocol import OpenAIError
from .tokenize_routes import add_tokenizer_routes

log = logging.getLogger("fxcompiler.serving")


class InputsRequest(BaseModel):
    """A request of texts or token ids (``input``): vLLM's classify request, and the base of the embeddings one."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(InputsRequest):
    """OpenAI's embeddings request; ``normalize`` (default: the model's pooler) is vLLM's extension."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None
    user: str | None = None


class ScoreRequest(BaseModel):
    """vLLM's score request: one ``text_1`` against every ``text_2``, or equal-length lists pairwise."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(BaseModel):
    """The Jina / Cohere rerank request vLLM serves: ``documents`` ordered by relevance to ``query``."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(None, ge=0)  # None or 0: every document
    return_documents: bool = True


def _check_count(values: Any, param: str) -> None:
    """At most ``FXCOMPILER_MAX_INPUTS`` (2048) texts in one request (docs/security.md)."""
    cap = limit("INPUTS")
    if isinstance(values, list) and len(values) > cap:
        raise OpenAIError(f"{param} has {len(values)} items, at most {cap} are allowed (FXCOMPILER_MAX_INPUTS)",
                          param=param)


def _prompts(value: Any) -> list[Any]:
    """The ``input`` of an embeddings request as ``LLM.embed`` prompts (token-id lists become dicts)."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise OpenAIError("input must not be empty", param="input")
    if all(isinstance(v, int) for v in value):
        return [{"prompt_token_ids": list(value)}]
    _check_count(value, "input")
    if all(isinstance(v, list) for v in value):
        if any(not v for v in value):
            raise OpenAIError("input: a token-id list must not be empty", param="input")
        return [{"prompt_token_ids": list(v)} for v in value]
    return list(value)


def _vector(values: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":  # OpenAI's: little-endian float32 bytes
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return values


def build_pooling_app(llm: Any, *, api_key: str | None = None, model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving an encoder ``llm`` (``task_type`` embed or score)."""
    if llm.task == QA:
        raise NotImplementedError("serving a question-answering model: OpenAI's API has no route for it; use "
                                  "LLM.bert_forward (docs/encoder-tasks.md)")
    if llm.task not in (EMBED, SCORE):
        raise ValueError(f"build_pooling_app serves embedding and scoring models, not task {llm.task!r}")
    name = model_name or llm.model_id
    app, check_model = base_app(name, api_key)
    metrics = PoolingMetrics(name)
    app.state.metrics = metrics
    max_len = int(llm.max_seq_len_to_capture)
    id2label = getattr(getattr(llm, "model_config", None), "id2label", None) or {}
    labels = {int(k): str(v) for k, v in id2label.items()}
    add_tokenizer_routes(app, llm.tokenizer, check_model, max_len)
    lock = asyncio.Lock()

    async def run(method: Callable[[], Any], param: str):
        """One encoder call on a worker thread, one at a time; bad input is the request's 400."""
        t0 = time.perf_counter()
        async with lock:
            try:
                outs = await asyncio.to_thread(method)
            except (ValueError, TypeError) as exc:
                metrics.observe(t0, 0, "error")
                raise OpenAIError(str(exc), param=param) from None
            except Exception as exc:  # noqa: BLE001 - the server keeps serving; the request gets a 500
                log.exception("encoder request failed")
                metrics.observe(t0, 0, "error")
                raise OpenAIError(f"{type(exc).__name__}: {exc}", 500, "InternalServerError") from None
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        metrics.observe(t0, tokens, "stop")
        return outs, tokens

    def wrong_api(api: str, use: str):
        async def refuse(_request: Request):
            raise OpenAIError(f"The model `{name}` is an encoder model (task {llm.task!r}) and does not support "
                              f"the {api}; use {use}", param="model")
        return refuse

    use = "/v1/embeddings" if llm.task == EMBED else "/classify, /v1/score or /v1/rerank"
    app.post("/v1/completions")(wrong_api("Completions API", use))
    app.post("/v1/chat/completions")(wrong_api("Chat Completions API", use))

    add_status_routes(app, name=name, root=llm.model_id, max_model_len=max_len, healthy=lambda: True,
                      metrics=metrics.render)

    def prompts_for(req: InputsRequest, task: str, refusal: str) -> list[Any]:
        """The request's inputs as prompts, once it names this model and the model serves ``task``."""
        check_model(req.model)
        if llm.task != task:
            raise OpenAIError(f"The model `{name}` {refusal}", param="model")
        return _prompts(req.input)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest):
        prompts = prompts_for(req, EMBED, "is a cross-encoder (task 'score'): it scores pairs (/v1/score, "
                                          "/v1/rerank) and has no embeddings")
        params = PoolingParams(normalize=req.normalize, dimensions=req.dimensions)
        outs, tokens = await run(lambda: llm.embed(prompts, params), "input")
        data = [{"object": "embedding", "index": i, "embedding": _vector(o.outputs.embedding, req.encoding_format)}
                for i, o in enumerate(outs)]
        return {"object": "list", "data": data, "model": name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/classify")
    @app.post("/v1/classify", include_in_schema=False)
    async def classify(req: InputsRequest):
        prompts = prompts_for(req, SCORE, "is an embedding model: /classify needs a sequence-classification "
                                          "checkpoint (task 'score')")
        outs, tokens = await run(lambda: llm.classify(prompts), "input")
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.probs
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "object": "classification", "label": labels.get(best, str(best)),
                         "probs": probs, "num_classes": len(probs)})
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": name,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/v1/score")
    @app.post("/score", include_in_schema=False)
    async def score(req: ScoreRequest):
        check_model(req.model)
        _check_count(req.text_1, "text_1")
        _check_count(req.text_2, "text_2")
        outs, tokens = await run(lambda: llm.score(req.text_1, req.text_2), "text_1")
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": name,
                "data": [{"index": i, "object": "score", "score": o.outputs.score} for i, o in enumerate(outs)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @app.post("/v1/rerank")
    @app.post("/rerank", include_in_schema=False)
    async def rerank(req: RerankRequest):
        check_model(req.model)
        _check_count(req.documents, "documents")
        outs, tokens = await run(lambda: llm.score(req.query, req.documents), "documents")
        order = sorted(range(len(outs)), key=lambda i: -outs[i].outputs.score)  # stable: ties keep input order
        if req.top_n:
            order = order[:req.top_n]
        results = [{"index": i, "relevance_score": outs[i].outputs.score,
                    **({"document": {"text": req.documents[i]}} if req.return_documents else {})} for i in order]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": name, "results": results,
                "usage": {"total_tokens": tokens}}

    return app
