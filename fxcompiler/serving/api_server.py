"""``fxcompiler serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over ``AsyncLLMEngine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE streaming ending in ``[DONE]``,
``stream_options.include_usage`` / ``continuous_usage_stats``), ``GET /v1/models``, ``/health``,
``/version``, ``/metrics``, and the chat page at ``/`` (``static/chat.html``).
Errors use OpenAI's body with the status in ``code`` (validation → 400, unknown model → 404,
not implemented → 501, dead engine → 503). A client that disconnects aborts its request.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from ..encoder_tasks import GENERATE
from ..engine_args import EngineArgs
from .app_base import add_status_routes, base_app
from .cli_args import add_serve_args  # noqa: F401 - re-exported
from ..outputs import RequestOutput
from ..sampling_params import RequestOutputKind
from .engine import AsyncLLMEngine, EngineDeadError, LLMEngine
from .metrics import ServerMetrics
from ..guided_decoding import GuidedDecodingParams
from .protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, message_dicts
from .tool_parsers import calls_from_forced, check_tools, forced_schema, parse_tool_calls
from .tokenize_routes import add_tokenizer_routes
from .tool_streaming import ToolCallStreamer

log = logging.getLogger("fxcompiler.serving")


class ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that closes its body iterator however the response ends. Under ASGI 2.4 (uvicorn
    0.55) Starlette ends a stream whose client went away by raising ``ClientDisconnect`` out of its ``async for``
    without closing the generator, which then finishes (and aborts its request) only when the cyclic garbage
    collector reaches it: seconds later, or never before the request has generated all its tokens."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


# The page loads nothing from elsewhere: scripts and styles are inline, requests go to this server only.
_PAGE_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
             "img-src 'self' data:; base-uri 'none'; form-action 'none'")


def chat_page() -> str:
    """The chat page's HTML (``fxcompiler/serving/static/chat.html``, shipped as package data)."""
    from importlib import resources

    return resources.files(__package__).joinpath("static", "chat.html").read_text(encoding="utf-8")


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's text, or the template given inline; checked to be valid Jinja."""
    if value is None:
        return None
    path = Path(value)
    try:
        is_file = path.is_file()
    except OSError:  # an inline template too long to be a file name
        is_file = False
    if is_file:
        text = path.read_text(encoding="utf-8")
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template ({{{{ }}}} / {{% %}})")
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: not a valid Jinja template: {exc}") from None
    return text


def build_app(engine: AsyncLLMEngine, *, api_key: str | None = None, model_name: str | None = None,
              tool_call_parser: str | None = None, chat_template: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (one model); ``chat_template``: the template of chat requests that
    give none (default: the model's)."""
    llm_engine = engine.engine
    name = model_name or llm_engine.model_name
    tokenizer = llm_engine.tokenizer
    defaults = llm_engine.default_sampling_params()
    metrics = ServerMetrics(engine.stats, name)
    engine.on_request_done.append(metrics.observe)
    app, check_model = base_app(name, api_key)
    app.state.engine = engine
    app.state.metrics = metrics
    add_tokenizer_routes(app, tokenizer, check_model, llm_engine.max_model_len, chat_template)

    page = chat_page()

    @app.get("/", include_in_schema=False)
    async def index():
        return HTMLResponse(page, headers={"Content-Security-Policy": _PAGE_CSP, "Cache-Control": "no-cache"})

    add_status_routes(app, name=name, root=llm_engine.llm.model_id, max_model_len=llm_engine.max_model_len,
                      healthy=lambda: engine.dead is None, metrics=metrics.render)

    async def start(prompts: list[Any], params, tokenizer_kwargs=None) -> list[tuple[str, AsyncIterator]]:
        """Validate every prompt before streaming any (errors become 400s)."""
        gens = []
        try:
            for p in prompts:
                rid = f"cmpl-{uuid.uuid4().hex}"
                stream_params = params.clone()
                # best_of > n: the n best are known only at the end (and the leading n change on the way)
                stream_params.output_kind = (RequestOutputKind.FINAL_ONLY if params.best_of > params.n
                                             else RequestOutputKind.DELTA)
                try:
                    llm_engine.process_prompt(p, stream_params, tokenizer_kwargs)  # raises before anything runs
                except (ValueError, TypeError) as exc:
                    raise OpenAIError(str(exc), param="prompt" if "prompt" in str(exc) else None) from None
                except NotImplementedError as exc:
                    raise OpenAIError(str(exc), 501, "NotImplementedError") from None
                gens.append((rid, engine.generate(p, stream_params, rid, tokenizer_kwargs=tokenizer_kwargs)))
        except EngineDeadError as exc:
            raise OpenAIError(str(exc), 503, "ServiceUnavailableError") from None
        return gens

    async def merged(gens) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several prompts' streams as they come: (prompt index, delta output)."""
        if len(gens) == 1:  # one prompt (n = 1): no queue and pump task per token
            try:
                async for out in gens[0][1]:
                    yield 0, out
            finally:
                await gens[0][1].aclose()  # a stream left early (disconnect): its request is aborted
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, gen):
            try:
                async for out in gen:
                    await queue.put((i, out, None))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, None, exc))
                return
            await queue.put((i, None, None))

        tasks = [asyncio.create_task(pump(i, g)) for i, (_, g) in enumerate(gens)]
        try:
            live = len(tasks)
            while live:
                i, out, exc = await queue.get()
                if exc is not None:
                    raise exc
                if out is None:
                    live -= 1
                    continue
                yield i, out
        finally:
            for t in tasks:
                t.cancel()  # the CancelledError runs each generator's finally: its request is aborted
            await asyncio.gather(*tasks, return_exceptions=True)
            for _, g in gens:
                await g.aclose()  # generators that never started

    async def until_disconnect(request: Request, coro):
        """Run ``coro``; cancel it (aborting its requests) if the client goes away first."""
        work = asyncio.ensure_future(coro)

        async def listen():
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(listen())
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            watcher.cancel()
            return work.result()
        work.cancel()
        return Response(status_code=499)

    def warn_ignored(req) -> None:
        ignored = req.ignored_fields()
        if ignored:
            log.warning("request fields ignored (not supported): %s", ", ".join(ignored))

    def logprobs_completion(c, offset0: int):
        tokens, token_lps, tops, offsets = [], [], [], []
        off = offset0
        for tok, entry in zip(c.token_ids, c.logprobs or []):
            text = tokenizer.decode([tok]) if tokenizer is not None else str(tok)
            tokens.append(text)
            token_lps.append(entry[tok].logprob if tok in entry else None)
            tops.append({(tokenizer.decode([t]) if tokenizer else str(t)): lp.logprob for t, lp in entry.items()})
            offsets.append(off)
            off += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def logprobs_prompt(prompt_ids: list[int], prompt_lps: list | None, top: int) -> dict:
        """The echoed prompt's tokens in OpenAI's completion logprobs: the first has none (``null``), as in
        vLLM; each other one its log-probability and the ``top`` most likely tokens (and itself)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        off = 0
        for pos, tok in enumerate(prompt_ids):
            text = tokenizer.decode([tok]) if tokenizer is not None else str(tok)
            entry = prompt_lps[pos] if prompt_lps is not None and pos < len(prompt_lps) else None
            tokens.append(text)
            offsets.append(off)
            off += len(text)
            if entry is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(entry[tok].logprob if tok in entry else None)
            tops.append({(tokenizer.decode([t]) if tokenizer else str(t)): lp.logprob for t, lp in entry.items()
                         if t == tok or (lp.rank is not None and lp.rank <= top)})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def prompt_logprobs_json(prompt_ids: list[int], prompt_lps: list | None, top: int) -> list | None:
        """vLLM's ``prompt_logprobs`` of a choice: per prompt position ``null`` or ``{token id: {logprob, rank,
        decoded_token}}`` (the prompt's token and the ``top`` most likely)."""
        if prompt_lps is None:
            return None
        return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                                 "decoded_token": lp.decoded_token} for t, lp in e.items()
                                        if t == prompt_ids[pos] or (lp.rank is not None and lp.rank <= top)}
                for pos, e in enumerate(prompt_lps)]

    def prompt_text(out) -> str:
        """What ``echo`` repeats: the prompt as sent, or its token ids decoded."""
        if out.prompt is not None:
            return out.prompt
        return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""

    def prompt_chunk(req, out, index: int) -> tuple[dict, int]:
        """The choice's first streamed chunk when it echoes the prompt or returns prompt_logprobs; and the
        text offset the completion's logprobs continue from."""
        choice = {"index": index, "text": prompt_text(out) if req.echo else "", "finish_reason": None,
                  "logprobs": None}
        offset = len(choice["text"])
        if req.echo and req.logprobs is not None:
            choice["logprobs"] = logprobs_prompt(out.prompt_token_ids, out.prompt_logprobs, req.logprobs)
            offset = sum(len(t) for t in choice["logprobs"]["tokens"])
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_token_ids, out.prompt_logprobs,
                                                             req.prompt_logprobs)
        return choice, offset

    def logprobs_chat(c, top: int):
        content = []
        for tok, entry in zip(c.token_ids, c.logprobs or []):
            text = tokenizer.decode([tok]) if tokenizer is not None else str(tok)
            lp = entry[tok].logprob if tok in entry else float("-inf")
            others = sorted(((t, v) for t, v in entry.items()), key=lambda kv: kv[1].rank or 0)
            content.append({"token": text, "logprob": max(lp, -9999.0), "bytes": list(text.encode()),
                            "top_logprobs": [{"token": tokenizer.decode([t]) if tokenizer else str(t),
                                              "logprob": max(v.logprob, -9999.0),
                                              "bytes": list((tokenizer.decode([t]) if tokenizer else str(t)).encode())}
                                             for t, v in others if v.rank is not None and v.rank <= top][:top]})
        return {"content": content}

    # -- /v1/completions ----------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        warn_ignored(req)
        if req.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        p = req.prompt
        if isinstance(p, str):
            prompts: list[Any] = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [{"prompt_token_ids": list(p)}]
        elif p and all(isinstance(x, str) for x in p):
            prompts = list(p)
        elif p and all(isinstance(x, list) for x in p):
            prompts = [{"prompt_token_ids": list(x)} for x in p]
        else:
            raise OpenAIError("prompt must be a non-empty string, list of strings or token ids", param="prompt")
        max_tokens = req.max_tokens if req.max_tokens is not None else defaults.get("max_tokens", 16)
        params = req.sampling_params(defaults, max_tokens, req.logprobs)
        # the prompt's log-probabilities: vLLM's prompt_logprobs, and echo with logprobs (OpenAI's: the echoed
        # prompt's tokens are scored too; lm-eval's loglikelihood requests rely on it)
        wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
        if wanted:
            params.prompt_logprobs = max(wanted)
        gens = await start(prompts, params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        n = req.n
        if req.stream:
            return ClosingStreamingResponse(stream_completion(gens, rid, created, req, n),
                                            media_type="text/event-stream")
        return await until_disconnect(request, full_completion(gens, rid, created, req, n))

    async def full_completion(gens, rid, created, req, n):
        acc: dict[tuple[int, int], dict] = {}
        prompt_tokens, prompt_ids, prompt_lps = {}, {}, {}
        async for i, out in merged(gens):
            prompt_tokens[i] = len(out.prompt_token_ids)
            prompt_ids[i] = out.prompt_token_ids
            if out.prompt_logprobs is not None:
                prompt_lps[i] = out.prompt_logprobs
            for pos, c in enumerate(out.outputs):
                # best_of > n (one final output): the choices in its order, most likely first, as LLM.generate
                j = pos if req.best_of is not None and req.best_of > n else c.index
                a = acc.setdefault((i, j), {"text": "", "ids": [], "lps": [], "finish": None,
                                            "prompt": prompt_text(out) if req.echo else ""})
                a["text"] += c.text
                a["ids"] += c.token_ids
                a["lps"] += c.logprobs or []
                a["finish"] = c.finish_reason or a["finish"]
        choices = []
        for (i, j), a in sorted(acc.items()):
            from ..outputs import CompletionOutput

            c = CompletionOutput(j, a["text"], a["ids"], logprobs=a["lps"])
            text = a["prompt"] + a["text"] if req.echo else a["text"]
            logprobs = None
            if req.logprobs is not None:
                if req.echo:
                    head = logprobs_prompt(prompt_ids[i], prompt_lps.get(i), req.logprobs)
                    tail = logprobs_completion(c, sum(len(t) for t in head["tokens"]))
                    logprobs = {k: head[k] + tail[k] for k in head}
                else:
                    logprobs = logprobs_completion(c, 0)
            choice = {"index": i * n + j, "text": text, "finish_reason": _finish(a["finish"]), "logprobs": logprobs}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(prompt_ids[i], prompt_lps.get(i), req.prompt_logprobs)
            choices.append(choice)
        completion = sum(len(a["ids"]) for a in acc.values())
        ptoks = sum(prompt_tokens.values())
        return {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices,
                "usage": {"prompt_tokens": ptoks, "completion_tokens": completion,
                          "total_tokens": ptoks + completion}}

    async def stream_completion(gens, rid, created, req, n):
        prompt_tokens, completion = {}, 0
        text_len: dict[int, int] = {}  # per choice: the text sent so far (the logprobs' text_offset)
        # Chunks without logprobs are formatted from a template (the bytes json.dumps gives for the chunk's
        # dict): every token of every stream passes here, on the event loop that shares the cores with the engine.
        head = ('data: {"id": ' + json.dumps(rid) + ', "object": "text_completion", "created": '
                + json.dumps(created) + ', "model": ' + json.dumps(name) + ', "choices": [{"index": ')
        with_logprobs = req.logprobs is not None
        leading = req.echo or req.prompt_logprobs is not None  # each choice starts with a chunk of its prompt
        started: set[int] = set()
        dumps = json.dumps
        single = len(gens) == 1  # one prompt: its stream read directly (one generator less per token)
        source = gens[0][1] if single else merged(gens)
        try:
            async for item in source:
                i, out = (0, item) if single else item
                prompt_tokens[i] = len(out.prompt_token_ids)
                for c in out.outputs:
                    completion += len(c.token_ids)
                    if leading and i * n + c.index not in started:
                        started.add(i * n + c.index)
                        choice, text_len[i * n + c.index] = prompt_chunk(req, out, i * n + c.index)
                        yield "data: " + json.dumps({"id": rid, "object": "text_completion", "created": created,
                                                     "model": name, "choices": [choice]}) + "\n\n"
                    # tokens whose text the detokenizer holds back (a partial UTF-8 character) still
                    # send their logprobs, as vLLM does; without logprobs they wait for their text
                    if not c.text and c.finish_reason is None and not (with_logprobs and c.token_ids):
                        continue
                    index = i * n + c.index
                    if not with_logprobs:
                        finish = _finish(c.finish_reason)
                        yield (f'{head}{index}, "text": {dumps(c.text)}, "finish_reason": '
                               f'{"null" if finish is None else dumps(finish)}, "logprobs": null}}]}}\n\n').encode()
                        continue
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": name,
                             "choices": [{"index": index, "text": c.text,
                                          "finish_reason": _finish(c.finish_reason),
                                          "logprobs": logprobs_completion(c, text_len.get(index, 0))}]}
                    text_len[index] = text_len.get(index, 0) + len(c.text)
                    yield f"data: {json.dumps(chunk)}\n\n"
            if req.stream_options and req.stream_options.include_usage:
                ptoks = sum(prompt_tokens.values())
                yield "data: " + json.dumps({"id": rid, "object": "text_completion", "created": created,
                                             "model": name, "choices": [],
                                             "usage": {"prompt_tokens": ptoks, "completion_tokens": completion,
                                                       "total_tokens": ptoks + completion}}) + "\n\n"
        except EngineDeadError as exc:
            yield "data: " + json.dumps(OpenAIError(str(exc), 503, "ServiceUnavailableError").body()) + "\n\n"
        finally:
            if single:
                await source.aclose()  # a stream left early (disconnect): its request is aborted
        yield "data: [DONE]\n\n"

    # -- /v1/chat/completions -----------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        warn_ignored(req)
        if tokenizer is None:
            raise OpenAIError("this model has no tokenizer/chat template", 400)
        try:
            functions = check_tools(req.tools, req.tool_choice)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="tools") from None
        tool_choice = req.tool_choice
        if tool_choice is None:
            tool_choice = "auto" if functions and tool_call_parser else "none"
        if tool_choice == "auto" and not tool_call_parser:
            raise OpenAIError('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                              "--tool-call-parser", param="tool_choice")
        forced = forced_schema(functions, tool_choice, req.parallel_tool_calls) if functions else None
        if forced is not None and req.response_format is not None:
            raise OpenAIError("response_format cannot be combined with a forced tool_choice", param="response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")  # None: up to the context
        params = req.sampling_params(defaults, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        if forced is not None:
            try:
                params.guided_decoding = GuidedDecodingParams(json=forced)
            except (ValueError, TypeError) as exc:
                raise OpenAIError(str(exc), param="tools") from None
        tools_mode = "none" if tool_choice == "none" or not functions else ("forced" if forced else "auto")
        try:
            prompt = tokenizer.apply_chat_template(message_dicts(req.messages), tokenize=False,
                                                   add_generation_prompt=req.add_generation_prompt,
                                                   chat_template=req.chat_template or chat_template,
                                                   tools=req.tools)
        except OpenAIError:
            raise
        except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
            raise OpenAIError(f"chat template failed: {exc}", param="messages") from None
        gens = await start([prompt], params, {"add_special_tokens": False})
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            return ClosingStreamingResponse(stream_chat(gens, rid, created, req, tools_mode, tool_choice),
                                     media_type="text/event-stream")
        return await until_disconnect(request, full_chat(gens, rid, created, req, tools_mode, tool_choice))

    def tool_message(text: str, finish: str | None, tools_mode: str, tool_choice) -> tuple[dict, str | None]:
        """The assistant message of one choice (tool calls parsed out when tools are on), its finish reason."""
        calls: list = []
        content: str | None = text
        if tools_mode == "forced" and finish == "stop":
            try:
                calls = calls_from_forced(text, tool_choice)
                content = None
            except (ValueError, KeyError, TypeError):  # cut short: the text stays content
                calls = []
        elif tools_mode == "auto":
            content, calls = parse_tool_calls(tool_call_parser, text)
            content = content or None
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
            return message, "tool_calls"
        return message, _finish(finish)

    async def full_chat(gens, rid, created, req, tools_mode="none", tool_choice=None):
        from ..outputs import CompletionOutput

        acc: dict[int, dict] = {}
        ptoks = 0
        async for _, out in merged(gens):
            ptoks = len(out.prompt_token_ids)
            for c in out.outputs:
                a = acc.setdefault(c.index, {"text": "", "ids": [], "lps": [], "finish": None})
                a["text"] += c.text
                a["ids"] += c.token_ids
                a["lps"] += c.logprobs or []
                a["finish"] = c.finish_reason or a["finish"]
        choices = []
        for j, a in sorted(acc.items()):
            message, finish = tool_message(a["text"], a["finish"], tools_mode, tool_choice)
            choices.append({"index": j, "message": message, "finish_reason": finish,
                            "logprobs": logprobs_chat(CompletionOutput(j, a["text"], a["ids"], logprobs=a["lps"]),
                                                      req.top_logprobs or 0) if req.logprobs else None})
        completion = sum(len(a["ids"]) for a in acc.values())
        return {"id": rid, "object": "chat.completion", "created": created, "model": name, "choices": choices,
                "usage": {"prompt_tokens": ptoks, "completion_tokens": completion,
                          "total_tokens": ptoks + completion}}

    async def stream_chat(gens, rid, created, req, tools_mode="none", tool_choice=None):
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name}
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        ptoks, completion = 0, 0

        def event(choices: list[dict]) -> str:
            chunk = {**head, "choices": choices}
            if continuous:  # vLLM's continuous_usage_stats: the running usage in every chunk
                chunk["usage"] = {"prompt_tokens": ptoks, "completion_tokens": completion,
                                  "total_tokens": ptoks + completion}
            return "data: " + json.dumps(chunk) + "\n\n"

        for j in range(req.n):
            yield event([{"index": j, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                          "logprobs": None}])
        held: dict[int, str] = {}
        streamers: dict[int, ToolCallStreamer] = {}
        try:
            async for _, out in merged(gens):
                ptoks = len(out.prompt_token_ids)
                for c in out.outputs:
                    completion += len(c.token_ids)
                    if tools_mode == "auto":  # tool-call deltas as the model writes them
                        st = streamers.setdefault(c.index, ToolCallStreamer(tool_call_parser))
                        deltas = st.feed(c.text) if c.text else []
                        finish = None
                        if c.finish_reason is not None:
                            last, called = st.finish()
                            deltas += last
                            finish = "tool_calls" if called else _finish(c.finish_reason)
                        for k, delta in enumerate(deltas):
                            yield event([{"index": c.index, "delta": delta, "logprobs": None,
                                          "finish_reason": finish if k == len(deltas) - 1 else None}])
                        if finish is not None and not deltas:
                            yield event([{"index": c.index, "delta": {}, "finish_reason": finish, "logprobs": None}])
                        continue
                    if tools_mode != "none":  # a forced call is parsed from the whole text: sent when it ends
                        held[c.index] = held.get(c.index, "") + c.text
                        if c.finish_reason is None:
                            continue
                        message, finish = tool_message(held.pop(c.index), c.finish_reason, tools_mode, tool_choice)
                        delta = {"content": message["content"]} if message["content"] else {}
                        if "tool_calls" in message:
                            delta["tool_calls"] = [{"index": k, **tc} for k, tc in enumerate(message["tool_calls"])]
                        choice = {"index": c.index, "delta": delta, "finish_reason": finish, "logprobs": None}
                        yield event([choice])
                        continue
                    if not c.text and c.finish_reason is None and not (req.logprobs and c.token_ids):
                        continue  # held-back text (a partial UTF-8 character): sent with the next delta
                    choice = {"index": c.index, "delta": {"content": c.text} if c.text else {},
                              "finish_reason": _finish(c.finish_reason),
                              "logprobs": logprobs_chat(c, req.top_logprobs or 0) if req.logprobs else None}
                    yield event([choice])
            if req.stream_options and req.stream_options.include_usage:
                yield "data: " + json.dumps({**head, "choices": [], "usage": {
                    "prompt_tokens": ptoks, "completion_tokens": completion,
                    "total_tokens": ptoks + completion}}) + "\n\n"
        except EngineDeadError as exc:
            yield "data: " + json.dumps(OpenAIError(str(exc), 503, "ServiceUnavailableError").body()) + "\n\n"
        yield "data: [DONE]\n\n"

    return app


def _finish(reason: str | None) -> str | None:
    if reason is None:
        return None
    return reason if reason in ("stop", "length", "tool_calls") else "stop"


def run_server(args: argparse.Namespace) -> int:
    """Build the engine, serve until SIGINT/SIGTERM (uvicorn stops accepting, finishes, then the engine stops)."""
    import uvicorn

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    engine_args = EngineArgs.from_cli_args(args)
    chat_template = load_chat_template(args.chat_template)  # before the engine: a bad flag fails at once
    llm = engine_args.create_llm()
    try:
        task = llm.__dict__.get("task", GENERATE)  # an artifact's LLM (text generation) has no task attribute
        if task == GENERATE:
            eng = LLMEngine(llm, engine_args)
            eng.owns_llm = True  # the engine's shutdown shuts the LLM down
            aeng = AsyncLLMEngine(eng)
            parser = args.tool_call_parser if args.enable_auto_tool_choice else None
            app = build_app(aeng, api_key=args.api_key, model_name=engine_args.model_name, tool_call_parser=parser,
                            chat_template=chat_template)
            close = aeng.shutdown
        else:  # an embedding model or a cross-encoder
            from .pooling_server import build_pooling_app

            if args.chat_template is not None or args.enable_auto_tool_choice:
                raise ValueError(f"--chat-template and --enable-auto-tool-choice are for text generation; "
                                 f"{engine_args.model} is an encoder model (task {task!r})")
            app = build_pooling_app(llm, api_key=args.api_key, model_name=engine_args.model_name)
            close = llm.shutdown
    except BaseException:
        llm.shutdown()
        raise
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=30)
    server = uvicorn.Server(config)  # installs SIGINT/SIGTERM handlers: graceful shutdown
    stopped_by: list[int] = []
    # uvicorn re-raises the signal it caught once it has shut down, to the handlers found at start:
    # these record it, so that a graceful stop exits 0 after the engine has shut down too.
    previous = {sig: signal.signal(sig, lambda signum, _frame: stopped_by.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stopped_by:
        log.warning("stopped by signal %d after a graceful shutdown", stopped_by[0])
    return 0
