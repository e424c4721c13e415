"""vLLM's ``/tokenize`` and ``/detokenize``: the server's own tokenizer (and chat template) as a service, so that
clients count and cut prompts exactly as the engine will."""
from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from .protocol import ChatMessage, OpenAIError, message_dicts


class TokenizeRequest(BaseModel):
    """A ``prompt`` (``add_special_tokens`` as a completion request) or chat ``messages`` (rendered with the
    chat template, as a chat request)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def add_tokenizer_routes(app: FastAPI, tokenizer: Any, check_model: Callable[[str | None], None],
                         max_model_len: int, chat_template: str | None = None) -> None:
    """``POST /tokenize`` → ``{count, max_model_len, tokens}``; ``POST /detokenize`` → ``{prompt}``."""

    def need_tokenizer():
        if tokenizer is None:
            raise OpenAIError("this model has no tokenizer", 400)
        return tokenizer

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        tok = need_tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError("give either prompt or messages", param="prompt")
        try:
            if req.messages is not None:
                if not req.messages:
                    raise OpenAIError("messages must not be empty", param="messages")
                text = tok.apply_chat_template(message_dicts(req.messages), tokenize=False,
                                               add_generation_prompt=req.add_generation_prompt,
                                               chat_template=req.chat_template or chat_template)
                ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))  # as a chat request
            else:
                ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        except OpenAIError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer error is the request's fault
            raise OpenAIError(f"tokenization failed: {exc}", param="messages" if req.messages else "prompt") from None
        ids = [int(t) for t in ids]
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        tok = need_tokenizer()
        size = len(tok)
        bad = [t for t in req.tokens if not 0 <= t < size]
        if bad:
            raise OpenAIError(f"token id {bad[0]} is outside the vocabulary [0, {size})", param="tokens")
        return {"prompt": tok.decode(req.tokens)}
