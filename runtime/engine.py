"""The engine loop: schedule → run the bucket's pipeline → sample → update KV/blocks → outputs.

``step()`` runs one model step and returns the :class:`RequestOutput` s it produced,
shaped by each request's ``output_kind`` (CUMULATIVE, DELTA, FINAL_ONLY).
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from fxcompiler.outputs import CompletionOutput, Logprob, RequestOutput
from fxcompiler.sampling_params import RequestOutputKind, SamplingParams

from .detokenizer import IncrementalDetokenizer
from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import Scheduler
from .sequence import Sequence

log = logging.getLogger("fxcompiler.engine")


@dataclass
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    padded_tokens: int = 0
    interleaved_prefills: int = 0  # prefill steps that ran while other sequences were mid-decode
    preemptions: int = 0


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    sent: list[int] = field(default_factory=list)  # DELTA: tokens already reported per completion
    sent_text: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class Engine:
    """In-process engine over one model runner (continuous batching, paged KV)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, tokenizer: Any, eos_token_ids: frozenset[int],
                 max_context: int, sampler: Sampler | None = None):
        self.runner = runner
        self.scheduler = scheduler
        self.sampler = sampler or Sampler()
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_context = max_context
        self.requests: dict[str, RequestState] = {}
        self.stats = EngineStats()
        self._arrival = itertools.count()

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.n != 1 or params.best_of not in (None, 1) or params.use_beam_search:
            raise NotImplementedError("n > 1, best_of > 1 and beam search are not implemented yet "
                                      "(parallel sampling and beam search belong to the decoding issue)")
        if params.prompt_logprobs:
            raise NotImplementedError("prompt_logprobs is not implemented yet")
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        seq = Sequence(request_id, 0, list(prompt_token_ids), params, next(self._arrival), eos_token_ids=eos,
                       generator=gen, prompt=prompt, logprobs=[] if params.logprobs is not None else None)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                                     skip_special_tokens=params.skip_special_tokens)
        self.requests[request_id] = RequestState(request_id, prompt, seq.prompt_token_ids, params, [seq], [0], [0])
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for s in state.seqs:
                if not s.is_finished:
                    self.scheduler.finish(s, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        seqs = batch.seqs
        logits = self.runner.execute(batch)
        out = self.sampler(logits, seqs)
        self._account(batch)
        touched: dict[str, RequestState] = {}
        want_top = out.top_logprobs
        for i, (seq, token) in enumerate(zip(seqs, out.token_ids)):
            seq.output_token_ids.append(token)
            seq.cumulative_logprob += out.logprobs[i]
            if seq.logprobs is not None:
                entry = {token: Logprob(out.logprobs[i], None, None)}
                if want_top is not None:
                    for rank, (tid, lp) in enumerate(want_top[i][: seq.params.logprobs], start=1):
                        entry.setdefault(tid, Logprob(lp, rank, None))
                seq.logprobs.append(entry)
            if seq.detokenizer is not None:
                seq.detokenizer.push([token])
            self._check_stop(seq, token)
            touched[seq.request_id] = self.requests[seq.request_id]
        return [o for st in touched.values() if (o := self._make_output(st)) is not None]

    def _account(self, batch) -> None:
        s = self.stats
        s.steps += 1
        real = sum(q.num_tokens for q in batch.seqs) if batch.is_prefill else len(batch.seqs)
        if batch.is_prefill:
            if len(self.scheduler.running) > len(batch.seqs):
                s.interleaved_prefills += 1
            s.prefill_steps += 1
            s.prompt_tokens += real
            s.padded_tokens += batch.bucket.batch_size * batch.bucket.attention_size - real
        else:
            s.decode_steps += 1
            s.padded_tokens += batch.bucket.batch_size - real
        s.generated_tokens += len(batch.seqs)
        s.preemptions = self.scheduler.num_preemptions

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        n_out = len(seq.output_token_ids)
        reason, stop_reason = None, None
        if token in seq.eos_token_ids and n_out >= p.min_tokens:
            reason = "stop"
        elif p.stop_token_ids and token in p.stop_token_ids and n_out >= p.min_tokens:
            reason, stop_reason = "stop", token
        elif p.stop and seq.detokenizer is not None and n_out >= p.min_tokens:
            text = seq.detokenizer.text
            for s in p.stop:
                if s in text:
                    reason, stop_reason = "stop", s
                    break
        if reason is None and (n_out >= p.max_tokens or seq.num_tokens >= self.max_context):
            reason = "length"
        if reason is not None:
            seq.stop_reason = stop_reason
            self.scheduler.finish(seq, reason)

    def _text(self, seq: Sequence) -> str:
        if seq.detokenizer is None:
            return ""
        if seq.is_finished:
            seq.detokenizer.flush()
        text = seq.detokenizer.text
        if isinstance(seq.stop_reason, str):
            cut = text.find(seq.stop_reason)
            if cut >= 0:
                text = text[: cut + (len(seq.stop_reason) if seq.params.include_stop_str_in_output else 0)]
        return text

    def _make_output(self, st: RequestState) -> RequestOutput | None:
        kind = st.params.output_kind
        finished = st.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = []
        for j, seq in enumerate(st.seqs):
            text = self._text(seq)
            ids = seq.output_token_ids
            logprobs = seq.logprobs
            if kind == RequestOutputKind.DELTA:
                ids, text = ids[st.sent[j]:], text[st.sent_text[j]:]
                logprobs = logprobs[st.sent[j]:] if logprobs is not None else None
                st.sent[j] += len(ids)
                st.sent_text[j] += len(text)
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(ids), cumulative_logprob=seq.cumulative_logprob,
                logprobs=logprobs, finish_reason=seq.finish_reason if seq.is_finished else None,
                stop_reason=seq.stop_reason))
        if finished:
            self.requests.pop(st.request_id, None)
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, completions, finished)
