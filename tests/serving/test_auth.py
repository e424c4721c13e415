"""``APIKeyMiddleware``: /v1 needs the bearer key (OpenAI's 401 body otherwise); a stream passes through whole."""
from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from starlette.testclient import TestClient

from fxcompiler.serving.auth import APIKeyMiddleware

KEY = "sk-test"


@pytest.fixture()
def http() -> TestClient:
    app = FastAPI()

    @app.get("/v1/stream")
    async def stream():
        async def body():
            for i in range(3):
                yield f"data: {i}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {"ok": True}

    app.add_middleware(APIKeyMiddleware, api_key=KEY)
    return TestClient(app)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Bearer {KEY}x"}])
def test_v1_without_the_key_is_401(http, headers):
    r = http.get("/v1/stream", headers=headers)
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == 401 and err["type"] == "AuthenticationError" and "API key" in err["message"]


def test_v1_with_the_key_streams_every_chunk(http):
    with http.stream("GET", "/v1/stream", headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines == ["data: 0", "data: 1", "data: 2", "data: [DONE]"]


def test_other_routes_need_no_key(http):
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/score", "/rerank", "/classify"])
def test_model_routes_outside_v1_need_the_key(path):
    app = FastAPI()
    app.post(path)(lambda: {"ok": True})
    app.add_middleware(APIKeyMiddleware, api_key=KEY)
    http = TestClient(app)
    assert http.post(path).status_code == 401
    assert http.post(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_empty_key_is_refused():
    with pytest.raises(ValueError, match="api_key"):
        APIKeyMiddleware(FastAPI(), "")
