"""``--api-key``: a pure ASGI middleware that answers requests to the model's routes (``/v1``, and the
``/tokenize``, ``/detokenize``, ``/score``, ``/rerank``, ``/classify`` ones outside it) without ``Authorization: Bearer <key>``
with OpenAI's 401 body. ``/``, ``/health``, ``/version`` and ``/metrics`` stay open (probes and scrapers).

Pure ASGI, not Starlette's ``@app.middleware("http")`` (``BaseHTTPMiddleware``): that one re-streams every
response body through an anyio memory stream and a second task, a few task hops and checkpoints per SSE
chunk; a request that passes this check goes to the app untouched.
"""
from __future__ import annotations

import hmac
from typing import Any, Awaitable, Callable

from starlette.responses import JSONResponse

from .protocol import OpenAIError

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]

__all__ = ["APIKeyMiddleware"]


# vLLM guards /v1 only; the routes that run the model or its tokenizer outside /v1 are guarded here too
PROTECTED = ("/v1", "/tokenize", "/detokenize", "/score", "/rerank", "/classify")


class APIKeyMiddleware:
    """Require ``Authorization: Bearer <api_key>`` on HTTP requests to :data:`PROTECTED` paths."""

    def __init__(self, app: ASGIApp, api_key: str):
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED) and not self._authorised(scope):
            exc = OpenAIError("invalid or missing API key", 401, "AuthenticationError")
            await JSONResponse(exc.body(), status_code=exc.status)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorised(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False
