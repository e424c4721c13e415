"""The engine loop: schedule → run the bucket's pipeline → sample → update KV/blocks → outputs.

``step()`` runs one model step and returns the :class:`RequestOutput` s it produced,
shaped by each request's ``output_kind`` (CUMULATIVE, DELTA, FINAL_ONLY).
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from fxcompiler.outputs import CompletionOutput, Logprob, RequestOutput
from fxcompiler.param_memory import trim_heap
from fxcompiler.sampling_params import RequestOutputKind, SamplingParams

from . import admission
from .beam_search import BeamSearch
from .detokenizer import IncrementalDetokenizer
from .model_runner import ModelRunner
from .sampler import Sampler, _apply_penalties
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
    prefill_chunks: int = 0  # prefill steps that computed one chunk of a long prompt
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which reused from cached blocks (not recomputed)
    prefix_cache_evictions: int = 0
    copies_on_write: int = 0  # shared blocks copied before a forked sequence wrote into them
    spec_verify_steps: int = 0  # speculative decoding: decode steps run as verify steps
    spec_verified_seqs: int = 0  # sequences (summed over verify steps) that had drafts verified
    spec_proposed_tokens: int = 0  # drafted tokens verified
    spec_accepted_tokens: int = 0  # of which accepted

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_proposed_tokens if self.spec_proposed_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verified sequence and step (accepted drafts + the target's token)."""
        return 1.0 + self.spec_accepted_tokens / self.spec_verified_seqs if self.spec_verified_seqs else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    sent: list[int] = field(default_factory=list)  # DELTA: tokens already reported per completion
    sent_text: list[int] = field(default_factory=list)
    beam: BeamSearch | None = None  # beam search state
    beams: list[Sequence] | None = None  # running beams, one entry per beam (the first step: k times one sequence)

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(s.is_finished for s in self.seqs)


class Engine:
    """In-process engine over one model runner (continuous batching, paged KV)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, tokenizer: Any, eos_token_ids: frozenset[int],
                 max_context: int, sampler: Sampler | None = None, vocab_size: int | None = None):
        self.vocab_size = vocab_size  # token ids are checked against it at add_request (None: not checked)
        self._grammars = None  # structured output: runtime.structured_output.GrammarCompiler, on first use
        self.runner = runner
        self.scheduler = scheduler
        self.sampler = sampler or Sampler()
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_context = max_context
        self.requests: dict[str, RequestState] = {}
        self.stats = EngineStats()
        self._token_text: dict[int, str] = {}
        self.beam_sharing = None  # KvCacheSharingAcrossBeamsConfig: its rules bind every request
        self._arrival = itertools.count()
        self.speculator = None  # runtime.speculative.SpeculativeDecoder when speculative decoding is on

    # -- requests -------------------------------------------------------------------------
    def configure(self, *, enable_prefix_caching: bool | None = None, prefill_chunk_size: int | None = None,
                  kv_cache_sharing_across_beams=None) -> None:
        """Switch prefix caching and chunked prefill, set the beam-sharing rules (before requests are added)."""
        if kv_cache_sharing_across_beams is not None:
            self.beam_sharing = kv_cache_sharing_across_beams
        if enable_prefix_caching is not None:
            self.scheduler.blocks.enable_prefix_caching = bool(enable_prefix_caching)
        if prefill_chunk_size is not None:
            if isinstance(prefill_chunk_size, bool) or not isinstance(prefill_chunk_size, int) \
                    or prefill_chunk_size < 1:
                raise ValueError(f"prefill_chunk_size must be a positive int, got {prefill_chunk_size!r}")
            self.scheduler.prefill_chunk_size = prefill_chunk_size

    def _new_seq(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None, generator: torch.Generator | None) -> Sequence:
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        seq = Sequence(request_id, index, prompt_token_ids, params, next(self._arrival), eos_token_ids=eos,
                       generator=generator, prompt=prompt, logprobs=[] if params.logprobs is not None else None)
        if params.guided_decoding is not None:
            seq.grammar = self.grammars().new_state(params.guided_decoding)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                                     skip_special_tokens=params.skip_special_tokens)
        return seq

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        prompt_token_ids = admission.check_token_ids(prompt_token_ids, self.vocab_size)
        self.check_params(params)
        admission.check_bounds(params, self.vocab_size)
        admission.check_fits(len(prompt_token_ids), params, self.scheduler.blocks, self.max_context)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        seq = self._new_seq(request_id, 0, list(prompt_token_ids), params, prompt, gen)
        seq.pending_forks = (params.best_of or params.n) - 1
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        st = RequestState(request_id, prompt, seq.prompt_token_ids, params, [seq], [0], [0])
        if params.use_beam_search:
            max_new = params.max_tokens if params.max_tokens is not None else self.max_context - len(prompt_token_ids)
            st.beam = BeamSearch(params.best_of, len(seq.eos_token_ids | set(params.stop_token_ids)),
                                 len(prompt_token_ids), min(max_new, self.max_context - len(prompt_token_ids)),
                                 params.length_penalty, params.early_stopping)
            st.beams = [seq] * params.best_of
        self.requests[request_id] = st
        self.scheduler.add(seq)

    def prefix_tokens(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Leading prompt tokens this engine would not compute again: K/V in its prefix cache or
        computed first by a request it holds (the data-parallel router's cache affinity)."""
        if params.prompt_logprobs is not None:
            return 0
        held = [s for st in list(self.requests.values()) for s in st.seqs if not s.is_finished]
        return self.scheduler.blocks.prefix_tokens(list(prompt_token_ids), held)

    def check_params(self, params: SamplingParams) -> None:
        """Rules that depend on the engine (``kv_cache_sharing_across_beams_config``, a guided_decoding
        grammar that compiles for this tokenizer); ValueError."""
        if params.guided_decoding is not None:
            self.grammars().grammar(params.guided_decoding)
        cfg = self.beam_sharing
        if cfg is None:
            return
        if not params.use_beam_search:
            raise ValueError("kv_cache_sharing_across_beams_config is set: requests must use beam search "
                             "(use_beam_search=True)")
        if params.best_of != cfg.beam_width:
            raise ValueError(f"kv_cache_sharing_across_beams_config.beam_width={cfg.beam_width}: best_of must equal "
                             f"it, got best_of={params.best_of}")
        if params.max_tokens is None or params.max_tokens > cfg.max_new_tokens:
            raise ValueError(f"kv_cache_sharing_across_beams_config.max_new_tokens={cfg.max_new_tokens}: max_tokens "
                             f"must be at most that, got {params.max_tokens}")

    def grammars(self):
        """The structured-output grammar compiler of this engine's tokenizer (built on first use)."""
        if self._grammars is None:
            from .structured_output import GrammarCompiler

            vocab = self.vocab_size if self.vocab_size is not None else len(self.tokenizer)
            self._grammars = GrammarCompiler(self.tokenizer, vocab, self.eos_token_ids)
        return self._grammars

    def abort_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for s in state.seqs:
                if not s.is_finished:
                    self.scheduler.finish(s, "abort")
            if self.speculator is not None:
                self.speculator.sweep()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        t0 = time.perf_counter()
        try:
            return self._step(batch)
        except Exception as exc:  # noqa: BLE001 - attributed to the batch's requests; the engine survives
            return self._fail_batch(batch, exc)
        finally:
            self.scheduler.note_step_time(batch, time.perf_counter() - t0)
            if self.speculator is not None:
                self.speculator.sweep()
            if not self.scheduler.has_unfinished():
                # drained: the steps' freed activations back to the OS (glibc kept ~25 MiB of them resident
                # after 16 SmolLM2 requests); a few ms, once per burst of work, never between its steps
                trim_heap()

    def _step(self, batch) -> list[RequestOutput]:
        if self.speculator is not None and not batch.is_prefill:
            outs = self.speculator.decode_step(self, batch)  # None: no drafts this step
            if outs is not None:
                return outs
        logits = self.runner.execute(batch)
        self._account(batch)
        return self._advance(batch, logits)

    def _advance(self, batch, logits: torch.Tensor) -> list[RequestOutput]:
        """Sample (or advance the beam search of) every sequence of ``batch`` from its rows of
        ``logits`` (``batch.logit_rows``); the outputs of the requests it touched."""
        blocks = self.scheduler.blocks
        rows: list[int] = []
        seqs: list[Sequence] = []
        touched: dict[str, RequestState] = {}
        beam_states: dict[str, RequestState] = {}
        for i, seq in enumerate(batch.seqs):
            first, count = batch.logit_rows[i]
            if seq.prompt_logprobs is not None and batch.is_prefill:
                self._collect_prompt_logprobs(seq, logits[first:first + count], seq.num_cached - batch.num_new[i])
            blocks.commit(seq)
            if seq.num_cached < seq.num_tokens:
                continue  # an intermediate chunk of a long prompt: nothing to sample yet
            if seq.params.use_beam_search:
                seq.pending_logits = logits[first + count - 1].clone()
                beam_states[seq.request_id] = self.requests[seq.request_id]
                continue
            rows.append(first + count - 1)
            seqs.append(seq)
            if seq.pending_forks:
                for child in self._fork(seq):
                    rows.append(first + count - 1)
                    seqs.append(child)
        for st in beam_states.values():
            if all(b.pending_logits is not None for b in st.beams):
                self._beam_step(st)
                touched[st.request_id] = st
        if not seqs:
            return [o for st in touched.values() if (o := self._make_output(st)) is not None]
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows, device=logits.device)]
        if any(s.grammar is not None for s in seqs):
            from .structured_output import mask_logits

            logits = mask_logits(logits, seqs)  # constrained rows only
        out = self.sampler(logits, seqs)
        self.stats.generated_tokens += len(seqs)
        want_top = out.top_logprobs
        for i, (seq, token) in enumerate(zip(seqs, out.token_ids)):
            seq.output_token_ids.append(token)
            if seq.grammar is not None:
                seq.grammar.accept(token)
            seq.cumulative_logprob += out.logprobs[i]
            if seq.logprobs is not None:
                rank = out.ranks[i] if out.ranks is not None else None
                entry = {token: Logprob(out.logprobs[i], rank, self._decoded(token))}
                if want_top is not None:
                    for r, (tid, lp) in enumerate(want_top[i][: seq.params.logprobs], start=1):
                        entry.setdefault(tid, Logprob(lp, r, self._decoded(tid)))
                seq.logprobs.append(entry)
            if seq.detokenizer is not None:
                seq.detokenizer.push([token])
            self._check_stop(seq, token)
            touched[seq.request_id] = self.requests[seq.request_id]
        return [o for st in touched.values() if (o := self._make_output(st)) is not None]

    def _fail_batch(self, batch, exc: Exception) -> list[RequestOutput]:
        """A step raised: fail the requests whose sequences were in it (each gets a finished
        output carrying a :class:`~runtime.admission.RequestError`), free their blocks, keep the rest."""
        rids = list(dict.fromkeys(s.request_id for s in batch.seqs))
        log.error("engine step failed for request(s) %s: %s: %s", rids, type(exc).__name__, exc)
        outs = []
        for rid in rids:
            st = self.requests.pop(rid, None)
            for s in (st.seqs if st is not None else [q for q in batch.seqs if q.request_id == rid]):
                if not s.is_finished:
                    self.scheduler.finish(s, "error")
            if st is None:
                continue
            err = admission.RequestError(rid, exc, len(rids))
            outs.append(RequestOutput(rid, st.prompt, st.prompt_token_ids,
                                      [CompletionOutput(0, "", [], finish_reason="error")], True, error=err))
        return outs

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """Parallel samples of ``seq``'s request: children sharing all its KV blocks."""
        st = self.requests[seq.request_id]
        children = []
        after = seq
        for k in range(1, seq.pending_forks + 1):
            gen = admission.child_generator(seq.params.seed, k) if seq.generator is not None else None
            child = self._new_seq(seq.request_id, k, seq.prompt_token_ids, seq.params, seq.prompt, gen)
            self.scheduler.blocks.fork(seq, child)
            self.scheduler.add_running(child, after)
            after = child
            st.seqs.append(child)
            st.sent.append(0)
            st.sent_text.append(0)
            children.append(child)
        seq.pending_forks = 0
        return children

    def _beam_step(self, st: RequestState) -> None:
        """All running beams have their next-token logits: advance the search one token."""
        p = st.params
        beams = st.beams
        distinct = list(dict.fromkeys(beams))
        rows = torch.stack([b.pending_logits for b in beams]).to(device="cpu", dtype=torch.float32)
        log_probs = torch.log_softmax(rows, dim=-1)
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.logit_bias \
                or p.min_tokens:
            _apply_penalties(log_probs, beams)
        for b in distinct:
            b.pending_logits = None
            b.pending_forks = 0
        eos = beams[0].eos_token_ids | frozenset(p.stop_token_ids)
        entries = None
        if p.logprobs is not None:
            top = torch.topk(log_probs, min(p.logprobs, log_probs.shape[1]), dim=-1) if p.logprobs else None

            def entries(beam, tok, lp):
                rank = int((log_probs[beam] > lp).sum()) + 1
                entry = {tok: Logprob(lp, rank, self._decoded(tok))}
                if top is not None:
                    for r, (v, t) in enumerate(zip(top.values[beam].tolist(), top.indices[beam].tolist()), start=1):
                        entry.setdefault(t, Logprob(v, r, self._decoded(t)))
                return entry
        step = st.beam.step(log_probs, [b.output_token_ids for b in beams], [b.logprobs for b in beams], eos,
                            entries)
        self.stats.generated_tokens += len(step.selected)
        if step.done:
            for b in distinct:
                self.scheduler.finish(b, "stop")
            st.seqs = distinct
            return
        used: set[int] = set()
        new: list[Sequence] = []
        for j, (b, _tok, _cum) in enumerate(step.selected):
            parent = beams[b]
            if id(parent) in used:  # a second continuation of one beam: a fork sharing its blocks
                child = self._new_seq(parent.request_id, j, parent.prompt_token_ids, p, parent.prompt, None)
                child.detokenizer = None
                child.output_token_ids = list(parent.output_token_ids)
                child.logprobs = list(parent.logprobs) if parent.logprobs is not None else None
                self.scheduler.blocks.fork(parent, child)
                self.scheduler.add_running(child, parent)
                new.append(child)
            else:
                used.add(id(parent))
                new.append(parent)
        for j, (seq, (_b, tok, cum)) in enumerate(zip(new, step.selected)):
            seq.output_token_ids.append(tok)
            seq.cumulative_logprob = cum
            seq.index = j
            if seq.logprobs is not None:
                seq.logprobs.append(st.beam.last_entries[j])
        for b in distinct:
            if id(b) not in used:
                self.scheduler.finish(b, "pruned")
        st.beams = new
        st.seqs = new

    def _decoded(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text

    def _collect_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor, start: int) -> None:
        """Entries for the prompt tokens that positions ``start...`` predict (raw model distribution)."""
        prompt = seq.prompt_token_ids
        P = len(prompt)
        n = min(logits.shape[0], P - 1 - start)
        if n <= 0 or len(seq.prompt_logprobs) >= start + 1 + n:
            return
        x = logits[:n]
        lp = torch.log_softmax(x if x.dtype in (torch.float32, torch.float64) else x.float(), dim=-1)
        targets = torch.tensor(prompt[start + 1:start + 1 + n], device=lp.device)
        vals = lp.gather(1, targets[:, None])
        ranks = ((lp > vals).sum(dim=-1) + 1).tolist()
        vals = vals.squeeze(1).tolist()
        k = seq.params.prompt_logprobs
        k = lp.shape[1] if k == -1 else min(k, lp.shape[1])
        top_v, top_i = (torch.topk(lp, k, dim=-1) if k > 0 else (None, None))
        top_v = top_v.tolist() if k > 0 else None
        top_i = top_i.tolist() if k > 0 else None
        for j in range(n):
            if len(seq.prompt_logprobs) != start + 1 + j:
                continue  # already collected (a recomputed sequence)
            tok = prompt[start + 1 + j]
            entry = {tok: Logprob(vals[j], ranks[j], self._decoded(tok))}
            if k > 0:
                for r, (tid, v) in enumerate(zip(top_i[j], top_v[j]), start=1):
                    entry.setdefault(tid, Logprob(v, r, self._decoded(tid)))
            seq.prompt_logprobs.append(entry)

    def _account(self, batch) -> None:
        s = self.stats
        s.steps += 1
        real = sum(batch.num_new)
        if batch.is_prefill:
            if len(self.scheduler.running) > len(batch.seqs):
                s.interleaved_prefills += 1
            s.prefill_steps += 1
            s.prompt_tokens += real
            s.padded_tokens += len(batch.seqs) * max(batch.num_new) - real  # the runner computes no bucket padding
            if batch.is_chunk or batch.bucket.kv_cache_size:
                s.prefill_chunks += 1
        else:
            s.decode_steps += 1
        b = self.scheduler.blocks
        s.preemptions = self.scheduler.num_preemptions
        s.prefix_cache_queries, s.prefix_cache_hits = b.prefix_queries, b.prefix_hits
        s.prefix_cache_evictions, s.copies_on_write = b.evictions, b.copies_on_write

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
        if reason is None and ((p.max_tokens is not None and n_out >= p.max_tokens)
                               or seq.num_tokens >= self.max_context):
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
        elif seq.params.stop and not seq.is_finished and not seq.params.include_stop_str_in_output:
            text = text[: len(text) - _stop_prefix_len(text, seq.params.stop)]  # may be the start of a stop string
        return text

    def _beam_output(self, st: RequestState) -> RequestOutput:
        p = st.params
        eos = self.eos_token_ids | frozenset(p.stop_token_ids) if not p.ignore_eos else frozenset(p.stop_token_ids)
        completions = []
        for i, h in enumerate(st.beam.best(p.n)):
            text = ""
            if self.tokenizer is not None:
                text = self.tokenizer.decode(h.token_ids, skip_special_tokens=p.skip_special_tokens,
                                             clean_up_tokenization_spaces=False)
            ended = bool(h.token_ids) and h.token_ids[-1] in eos
            stop_reason = h.token_ids[-1] if ended and h.token_ids[-1] in p.stop_token_ids else None
            completions.append(CompletionOutput(
                index=i, text=text, token_ids=list(h.token_ids), cumulative_logprob=h.cumulative_logprob,
                logprobs=h.logprobs, finish_reason="stop" if ended else "length", stop_reason=stop_reason))
        self.requests.pop(st.request_id, None)
        prompt_lp = st.seqs[0].prompt_logprobs if st.seqs else None
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, completions, True,
                             prompt_logprobs=list(prompt_lp) if prompt_lp is not None else None)

    def _make_output(self, st: RequestState) -> RequestOutput | None:
        kind = st.params.output_kind
        finished = st.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if st.beam is not None:
            return self._beam_output(st) if finished else None
        seqs = st.seqs
        n = st.params.n
        if len(seqs) > n:  # best_of > n: the n best by cumulative logprob
            seqs = sorted(seqs, key=lambda q: q.cumulative_logprob, reverse=True)[:n]
            if not finished:
                seqs.sort(key=lambda q: q.index)
        completions = []
        for seq in seqs:
            j = seq.index
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
        prompt_lp = st.seqs[0].prompt_logprobs
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, completions, finished,
                             prompt_logprobs=list(prompt_lp) if prompt_lp is not None else None)


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string (held back while
    streaming: emitted text must never have to be taken back when the stop string completes)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
