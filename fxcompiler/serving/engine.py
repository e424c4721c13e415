"""``LLMEngine`` (synchronous, step by step) and ``AsyncLLMEngine`` (one event-driven loop, many streams).

Shapes follow vLLM / furiosa-llm 2025.2: ``LLMEngine.from_engine_args(args)``,
``add_request(request_id, prompt | TokensPrompt, params)``, ``step() -> list[RequestOutput]``,
``abort_request``, ``has_unfinished_requests``; ``AsyncLLMEngine.generate(prompt, params, request_id)``
is an async iterator of ``RequestOutput`` honouring ``params.output_kind``, and ``abort(request_id)``.

How the async engine runs: one long-lived engine thread owns the runtime engine. Requests are
validated and tokenised on the caller's event loop, then queued; the thread adds/aborts queued
requests between steps, steps while anything is unfinished and *sleeps on an event* when idle
(no polling). Each step's outputs go to per-request streams in one ``call_soon_threadsafe``.

Back-pressure, per request: the engine always runs its requests in DELTA mode and a stream
*merges* the deltas that its consumer has not taken yet into one pending output. A slow consumer
therefore never stalls the engine (others keep getting tokens) and its pending state is bounded
by its own completion (it holds text and ids it would have received anyway), not by time.
"""
from __future__ import annotations

import asyncio
import copy
import functools
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, TypedDict

import torch

from runtime import openmp_team, worker_threads

from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger("fxcompiler.serving")

__all__ = ["TokensPrompt", "LLMEngine", "AsyncLLMEngine", "EngineDeadError", "RequestMetrics"]


class TokensPrompt(TypedDict, total=False):
    """A pre-tokenised prompt (vLLM's ``TokensPrompt``): ``prompt_token_ids`` and optionally its text."""

    prompt_token_ids: list[int]
    prompt: str


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an engine step raised, or the engine was shut down)."""


class LLMEngine:
    """Synchronous engine API over an ``LLM``'s runtime engine (the caller drives ``step()``)."""

    def __init__(self, llm: Any, engine_args: Any = None):
        self.llm = llm
        self.engine_args = engine_args
        self.engine = llm._require_engine()
        self.tokenizer = llm.tokenizer
        self._lock: threading.Lock = llm._lock  # the LLM's engine lock: also held by LLM.generate's steps
        self.owns_llm = False  # True when built by from_engine_args: its shutdown then shuts the LLM down

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> "LLMEngine":
        """Build the model an ``EngineArgs`` describes and wrap its engine."""
        eng = cls(engine_args.create_llm(), engine_args)
        eng.owns_llm = True
        return eng

    # -- properties ---------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        if self.engine_args is not None:
            return self.engine_args.model_name
        return self.llm.model_id

    @property
    def max_model_len(self) -> int:
        return self.llm.max_seq_len_to_capture

    def default_sampling_params(self) -> dict[str, Any]:
        """Sampling defaults from the model's ``generation_config`` (vLLM's behaviour), as field -> value
        (``max_tokens`` from its ``max_new_tokens``); empty when the model has no generation_config.json."""
        from ..generation_defaults import generation_defaults

        return generation_defaults(getattr(self.llm, "generation_config", None))

    # -- requests -----------------------------------------------------------------------------------
    def process_prompt(self, prompt: str | TokensPrompt, params: SamplingParams,
                       tokenizer_kwargs: dict | None = None) -> tuple[str | None, list[int], SamplingParams]:
        """Tokenise and validate one request: (prompt text, token ids, finalised params); ValueError/TypeError."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            _, texts, ids, finals = self.llm._prepare(prompt, params, None, tokenizer_kwargs)
            self.check_admission(ids[0], finals[0])
            return texts[0], ids[0], finals[0]
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            row = prompt["prompt_token_ids"]
            if not isinstance(row, (list, tuple)) or not row or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in row):
                raise ValueError("prompt_token_ids must be a non-empty list of ints")
            vocab = getattr(self.llm.geometry, "vocab_size", None)
            if vocab is not None and any(t < 0 or t >= vocab for t in row):
                raise ValueError(f"prompt_token_ids must be in [0, {vocab})")
            _, _, ids, finals = self.llm._prepare(None, params, [list(row)], None)
            self.check_admission(ids[0], finals[0])
            return prompt.get("prompt"), ids[0], finals[0]
        raise TypeError(f"prompt must be a str or a TokensPrompt dict, got {type(prompt).__name__}")

    def check_admission(self, ids: list[int], params: SamplingParams) -> None:
        """The runtime engine's admission checks (token range, engine rules, bounds, fits the KV cache),
        run before the request is queued so that a server can answer them as a 400 (ValueError/TypeError)."""
        from runtime import admission

        eng = getattr(self.engine, "replicas", [self.engine])[0]  # data-parallel replicas are alike
        admission.check_token_ids(ids, eng.vocab_size)
        eng.check_params(params)
        admission.check_bounds(params, eng.vocab_size)
        admission.check_fits(len(ids), params, eng.scheduler.blocks, eng.max_context)

    def add_request(self, request_id: str, prompt: str | TokensPrompt, params: SamplingParams,
                    tokenizer_kwargs: dict | None = None) -> None:
        """Queue one request; its outputs come from later ``step()`` calls, shaped by ``params.output_kind``."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        text, ids, p = self.process_prompt(prompt, params, tokenizer_kwargs)
        p.output_kind = params.output_kind
        with self._lock:
            self.engine.add_request(request_id, ids, p, text)

    def _add_processed(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams) -> None:
        with self._lock:
            self.engine.add_request(request_id, ids, params, text)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            for rid in ids:
                self.engine.abort_request(rid)

    def step(self) -> list[RequestOutput]:
        """Run one engine step (a prefill or a decode batch) and return the outputs it produced."""
        with self._lock:
            return self.engine.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.engine.requests)

    def stats(self) -> dict[str, float]:
        """A snapshot for gauges and counters (read without the lock: values may be one step stale)."""
        scheds = [r.scheduler for r in getattr(self.engine, "replicas", [self.engine])]  # data parallel: all
        st = self.engine.stats
        usable = max(1, sum(s.blocks.num_usable_blocks for s in scheds))
        return {"num_running": float(sum(len(s.running) for s in scheds)),
                "num_waiting": float(sum(len(s.waiting) for s in scheds)),
                "kv_cache_usage": 1.0 - sum(s.blocks.num_free_blocks for s in scheds) / usable,
                "prefix_cache_queries": float(sum(s.blocks.prefix_queries for s in scheds)),
                "prefix_cache_hits": float(sum(s.blocks.prefix_hits for s in scheds)),
                "num_preemptions": float(sum(s.num_preemptions for s in scheds)),
                "prompt_tokens": float(st.prompt_tokens), "generation_tokens": float(st.generated_tokens),
                "spec_decode_num_drafts": float(st.spec_verified_seqs),
                "spec_decode_num_draft_tokens": float(st.spec_proposed_tokens),
                "spec_decode_num_accepted_tokens": float(st.spec_accepted_tokens)}


@dataclass
class RequestMetrics:
    """Timestamps (``time.monotonic()``) and counts of one request, for the latency histograms."""

    arrival: float
    num_prompt_tokens: int = 0
    first_token: float | None = None
    last_token: float | None = None
    num_generation_tokens: int = 0
    finish_reason: str | None = None
    token_times: list[float] = field(default_factory=list)


def _merge(into: RequestOutput | None, out: RequestOutput) -> RequestOutput:
    """Fold a DELTA output into the not-yet-consumed one (texts, ids and logprobs appended)."""
    if into is None:
        return copy.copy(out) if not out.outputs else RequestOutput(
            out.request_id, out.prompt, out.prompt_token_ids,
            [_copy_completion(c) for c in out.outputs], out.finished, out.prompt_logprobs, out.metrics)
    by_index = {c.index: c for c in into.outputs}
    for c in out.outputs:
        old = by_index.get(c.index)
        if old is None:
            new = _copy_completion(c)
            into.outputs.append(new)
            by_index[c.index] = new
            continue
        old.text += c.text
        old.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + list(c.logprobs)
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason = c.finish_reason
        old.stop_reason = c.stop_reason
    if out.finished:  # the final output names the completions and their order (best_of > n: the n most likely)
        into.outputs = [by_index[c.index] for c in out.outputs]
    into.finished = out.finished
    return into


def _copy_completion(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                            list(c.logprobs) if c.logprobs is not None else None, c.finish_reason, c.stop_reason)


class _Stream:
    """One request's mailbox: merged pending deltas, filled on the engine thread, drained on the loop."""

    def __init__(self, request_id: str, metrics: RequestMetrics):
        self.request_id = request_id
        self.metrics = metrics
        self.pending: RequestOutput | None = None
        self.error: BaseException | None = None
        self.event = asyncio.Event()
        self.done = False

    def put(self, out: RequestOutput, now: float) -> None:  # on the event loop
        outputs = out.outputs
        n_new = len(outputs[0].token_ids) if len(outputs) == 1 else sum(len(c.token_ids) for c in outputs)
        if n_new:
            m = self.metrics
            if m.first_token is None:
                m.first_token = now
            m.last_token = now
            m.num_generation_tokens += n_new
            m.token_times.append(now)
        # the engine built ``out`` for this stream alone (a DELTA output, fresh lists): kept as it is
        # when nothing is pending (the usual case: the consumer keeps up), merged (copied) otherwise
        self.pending = out if self.pending is None else _merge(self.pending, out)
        self.event.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.event.set()


class AsyncLLMEngine:
    """Serves many concurrent ``generate`` streams from one event-driven engine thread."""

    def __init__(self, engine: LLMEngine, *, start: bool = True):
        self.engine = engine
        self._mu = threading.Lock()  # guards the queues below
        self._new: list[tuple[str, str | None, list[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._wake = threading.Event()
        self._closed = False
        self._job: worker_threads.Job | None = None  # _run on a reused engine worker thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, _Stream] = {}
        self.dead: BaseException | None = None
        self.on_request_done: list[Callable[[RequestMetrics], None]] = []
        self._ids = itertools.count()
        self.steps = 0

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> "AsyncLLMEngine":
        return cls(LLMEngine.from_engine_args(engine_args))

    # -- lifecycle ----------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("an AsyncLLMEngine serves one event loop; it was first used from another")
        if self._job is None:
            # a reused worker (runtime.worker_threads), not a thread per engine: each new native thread
            # builds its own OpenMP team, MKL buffers and malloc arena, which outlive the engine
            self._job = worker_threads.submit(functools.partial(self._run, torch.get_num_threads()))

    @property
    def is_running(self) -> bool:
        return self._job is not None and self._job.is_alive() and self.dead is None

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine loop: in-flight streams end with ``EngineDeadError``; then, when the engine built
        its LLM (``from_engine_args``), ``LLM.shutdown()``; an LLM passed in stays usable."""
        with self._mu:
            self._closed = True
        self._wake.set()
        if self._job is not None and self._job.thread is not threading.current_thread():
            self._job.join(timeout)
        if self.engine.owns_llm:
            self.engine.llm.shutdown()

    # -- the engine thread --------------------------------------------------------------------------
    def _run(self, threads: int) -> None:
        # A new native thread starts with OpenMP's default team size (OMP_NUM_THREADS), not the
        # creator's torch.set_num_threads() (`--threads`): the fxc kernels would run on fewer cores.
        torch.set_num_threads(threads)
        eng = self.engine
        while True:
            with self._mu:
                new, self._new = self._new, []
                aborts, self._aborts = self._aborts, []
                closed = self._closed
            if closed:
                self._fail_all(EngineDeadError("the engine was shut down"))
                with eng._lock:
                    for rid in list(eng.engine.requests):
                        eng.engine.abort_request(rid)
                return
            for rid, text, ids, params in new:  # before the aborts: an abort may name a request queued with it
                try:
                    eng._add_processed(rid, text, ids, params)
                except Exception as exc:  # noqa: BLE001 - handed to that request's consumer
                    self._deliver_error(rid, exc)
            if aborts:
                eng.abort_request(aborts)
            if not eng.has_unfinished_requests():
                openmp_team.release()  # idle: an LLM.generate of the same LLM may step on its caller's thread
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outs = eng.step()
            except BaseException as exc:  # noqa: BLE001 - the engine is dead; every stream learns why
                log.exception("engine step failed; the engine loop stops")
                self.dead = exc
                self._fail_all(EngineDeadError(f"engine step failed: {exc!r}"))
                return
            self.steps += 1
            if outs:
                self._loop.call_soon_threadsafe(self._dispatch, outs, time.monotonic())

    def _dispatch(self, outs: list[RequestOutput], now: float) -> None:  # on the event loop
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.error is not None:  # this request failed in a step (runtime.admission.RequestError); others go on
                stream.fail(out.error)
            else:
                stream.put(out, now)

    def _deliver_error(self, rid: str, exc: BaseException) -> None:
        def fail():
            stream = self._streams.get(rid)
            if stream is not None:
                stream.fail(exc)
        self._loop.call_soon_threadsafe(fail)

    def _fail_all(self, exc: BaseException) -> None:
        if self._loop is None or self._loop.is_closed():
            return

        def fail():
            for stream in list(self._streams.values()):
                stream.fail(exc)
        try:
            self._loop.call_soon_threadsafe(fail)
        except RuntimeError:  # the loop closed meanwhile
            pass

    # -- public API ---------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | TokensPrompt, params: SamplingParams,
                          tokenizer_kwargs: dict | None = None) -> "_Stream":
        """Validate, tokenise and queue a request (errors raise here, before anything streams)."""
        self._ensure_started()
        if self.dead is not None or self._closed:
            raise EngineDeadError("the engine is not running")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival = time.monotonic()
        text, ids, p = self.engine.process_prompt(prompt, params, tokenizer_kwargs)
        p.output_kind = RequestOutputKind.DELTA
        stream = _Stream(request_id, RequestMetrics(arrival, num_prompt_tokens=len(ids)))
        self._streams[request_id] = stream
        with self._mu:
            self._new.append((request_id, text, ids, p))
        self._wake.set()
        return stream

    async def generate(self, prompt: str | TokensPrompt, sampling_params: SamplingParams,
                       request_id: str | None = None, *, tokenizer_kwargs: dict | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream ``RequestOutput`` s of one request per ``sampling_params.output_kind``.

        Closing the iterator early (or cancelling the task consuming it) aborts the request."""
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        kind = sampling_params.output_kind
        stream = await self.add_request(request_id, prompt, sampling_params, tokenizer_kwargs)
        total: RequestOutput | None = None
        out: RequestOutput | None = None
        try:
            while True:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    stream.done = True  # failed: nothing left to abort
                    stream.metrics.finish_reason = "error"
                    raise stream.error
                out, stream.pending = stream.pending, None
                if out is None:
                    continue
                if out.finished:
                    stream.done = True
                if kind == RequestOutputKind.DELTA:
                    yield out
                else:
                    total = _merge(total, out)
                    if kind == RequestOutputKind.CUMULATIVE or total.finished:
                        yield _merge(None, total)
                if stream.done:
                    return
        finally:
            self._streams.pop(request_id, None)
            m = stream.metrics
            if not stream.done:
                m.finish_reason = "abort"
                self.abort(request_id)
            elif stream.error is not None:
                pass
            elif out is not None and out.outputs:
                m.finish_reason = out.outputs[0].finish_reason
            for hook in self.on_request_done:
                try:
                    hook(m)
                except Exception:  # noqa: BLE001 - metrics must not break a request
                    log.exception("on_request_done hook failed")

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op if it already finished); its stream, if still consumed, ends."""
        with self._mu:
            self._aborts.append(request_id)
        self._wake.set()

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    @property
    def num_streams(self) -> int:
        return len(self._streams)
