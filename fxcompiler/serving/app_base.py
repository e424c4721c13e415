"""What every fxcompiler HTTP app shares: OpenAI's error body for every error, the API key, ``/version`` and
the model-name check (one model per server)."""
from __future__ import annotations

import time
from typing import Callable

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from .auth import APIKeyMiddleware
from .protocol import OpenAIError


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def base_app(name: str, api_key: str | None) -> tuple[FastAPI, Callable[[str | None], None]]:
    """A FastAPI app answering validation and :class:`OpenAIError` errors with OpenAI's body, behind
    ``api_key`` when given, with ``/version``; and the check that a request names this server's model."""
    from .. import __version__

    app = FastAPI(title="fxcompiler", version=__version__)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in errs[:5])
        return error_response(OpenAIError(msg or "invalid request", param=loc))

    @app.exception_handler(OpenAIError)
    async def _openai(_req, exc: OpenAIError):
        return error_response(exc)

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    def check_model(model: str | None) -> None:
        if model is not None and model != name:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")

    return app, check_model


def add_status_routes(app: FastAPI, *, name: str, root: str, max_model_len: int, healthy: Callable[[], bool],
                      metrics: Callable[[], bytes]) -> None:
    """``/health`` (503 once ``healthy()`` is false), ``/metrics`` (Prometheus text) and ``/v1/models`` (this one
    model)."""

    @app.get("/health")
    async def health():
        return Response(status_code=200 if healthy() else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "fxcompiler", "root": root, "max_model_len": max_model_len}]}
