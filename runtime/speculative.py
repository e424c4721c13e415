"""Speculative decoding inside the engine's continuous batch.

A decode step the scheduler hands to :meth:`SpeculativeDecoder.decode_step` becomes a *verify*
step: every eligible sequence gets up to k drafted tokens from the proposer, and one target
forward computes, per sequence, its last token plus its drafts (k + 1 query tokens over the
cached context; ordinary sequences in the same batch compute their one token). The target's
distributions at those positions decide how many drafts are kept (greedy: while they equal the
target's argmax; sampling: the exact rejection rule of :mod:`runtime.rejection_sampler`, with
every penalty and filter of the request applied to the target's rows, each row seeing the
drafts before it as output tokens), plus one token from the target. Emitted tokens go through
the engine's stop checks one by one, so EOS, stop ids/strings and ``max_tokens`` cut an
accepted run. Afterwards the sequence's cache is rolled back to the accepted prefix (the slots
of rejected drafts return to the pool, in the target's cache and the draft's) and only then are
full blocks committed to the prefix cache.

Not speculated (they decode one token a step, in the same batch): beam search, ``n > 1`` /
``best_of > n`` (forked sequences share blocks), and sequences whose proposer found nothing.
The number of drafts adapts per sequence: it grows after a fully accepted run, shrinks to one
more than what was accepted, and speculation pauses (with doubling back-off) while the
acceptance rate stays low.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fxcompiler.ops.sampling import greedy_logprob
from fxcompiler.outputs import Logprob
from fxcompiler.pipeline import Bucket
from fxcompiler.sampling_params import SAMPLING_EPS

from .rejection_sampler import greedy_verify, rejection_sample
from .sampler import SamplingRow, _is_plain_greedy, _ranks, _top_logprobs, apply_penalties_and_warpers
from .scheduler import ScheduledBatch
from .sequence import Sequence

__all__ = ["SpeculativeConfig", "SpeculativeDecoder"]

# Below this acceptance rate (exponential average) a sequence stops speculating for a while.
LOW_ACCEPTANCE = 0.25
MAX_BACKOFF_STEPS = 32


@dataclass
class SpeculativeConfig:
    """``num_speculative_tokens``: drafts per step (the upper bound when ``adaptive``)."""

    num_speculative_tokens: int
    adaptive: bool = True

    def __post_init__(self):
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"num_speculative_tokens must be a positive int, got {k!r}")


@dataclass(slots=True)
class _Adapt:
    k: int
    ema: float = 1.0  # acceptance rate, exponentially averaged
    pause: int = 0  # decode steps left without speculation
    backoff: int = 2


def eligible(seq: Sequence) -> bool:
    p = seq.params
    return not p.use_beam_search and p.n == 1 and (p.best_of or 1) == 1 and not seq.pending_forks


class SpeculativeDecoder:
    def __init__(self, proposer, config: SpeculativeConfig):
        self.proposer = proposer
        self.config = config
        self._adapt: dict[Sequence, _Adapt] = {}

    # -- drafts ------------------------------------------------------------------------------
    def _budget(self, seq: Sequence, max_context: int) -> int:
        a = self._adapt.get(seq)
        if a is None:
            a = self._adapt[seq] = _Adapt(self.config.num_speculative_tokens)
        if a.pause > 0:
            a.pause -= 1
            return 0
        k = a.k if self.config.adaptive else self.config.num_speculative_tokens
        p = seq.params
        k = min(k, max_context - seq.num_tokens)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - len(seq.output_token_ids) - 1)
        return max(k, 0)

    def _learn(self, seq: Sequence, proposed: int, accepted: int) -> None:
        a = self._adapt[seq]
        kmax = self.config.num_speculative_tokens
        a.ema = 0.7 * a.ema + 0.3 * (accepted / proposed)
        a.k = min(kmax, a.k + 1) if accepted == proposed else max(1, accepted + 1)
        if self.config.adaptive and a.ema < LOW_ACCEPTANCE:
            a.pause, a.backoff = a.backoff, min(2 * a.backoff, MAX_BACKOFF_STEPS)
            a.ema = 0.5  # a fresh chance after the pause
        elif a.ema > 0.5:
            a.backoff = 2

    def sweep(self) -> None:
        """Forget finished sequences (and give back their draft cache)."""
        for seq in [s for s in self._adapt if s.is_finished]:
            del self._adapt[seq]
        self.proposer.sweep()

    # -- the verify step ---------------------------------------------------------------------
    def decode_step(self, engine, batch):
        """Run ``batch`` (a decode batch) as a verify step; None when no sequence has drafts (the
        engine then runs its ordinary decode step)."""
        blocks = engine.scheduler.blocks
        wants = []
        for s in batch.seqs:
            if eligible(s):
                k = self._budget(s, engine.max_context)
                if k > 0:
                    wants.append((s, k))
        if not wants:
            return None
        proposals = self.proposer.propose(wants)
        drafts: dict[Sequence, object] = {}
        for s, prop in proposals.items():
            if prop.tokens and blocks.reserve_lookahead(s, s.num_tokens + len(prop.tokens)):
                drafts[s] = prop
            else:
                self.proposer.accepted(s, s.num_tokens, 0)
        if not drafts:
            return None
        return self._verify(engine, batch, drafts)

    def _verify(self, engine, batch, drafts):
        runner, blocks = engine.runner, engine.scheduler.blocks
        seqs = batch.seqs
        toks = [[s.last_token] + (drafts[s].tokens if s in drafts else []) for s in seqs]
        n_before = [s.num_tokens for s in seqs]
        logits, layout = self._forward(runner, batch.bucket, seqs, toks)
        engine._account(batch)
        st = engine.stats
        st.spec_verify_steps += 1
        outs: list = []
        plain = [i for i, s in enumerate(seqs) if s not in drafts]
        if plain:  # one token each, advanced by the engine itself (beam search, forks, sampling)
            sub = ScheduledBatch(batch.bucket, [seqs[i] for i in plain], prefill=False, num_new=[1] * len(plain),
                                 logit_rows=[(j, 1) for j in range(len(plain))])
            outs = engine._advance(sub, logits[torch.tensor([layout[i][0] for i in plain], device=logits.device)])
        spec = [i for i, s in enumerate(seqs) if s in drafts]
        idx: list[int] = []
        for i in spec:
            idx.extend(range(layout[i][0], layout[i][0] + layout[i][1]))
        logits = logits[torch.tensor(idx, device=logits.device)]
        # one sampling row per computed position: the drafts before it count as output tokens
        rows: list[SamplingRow] = []
        for i in spec:
            s, t = seqs[i], toks[i]
            for j in range(len(t)):
                rows.append(SamplingRow(s.params, s.prompt_token_ids, s.output_token_ids + t[1:1 + j],
                                        s.eos_token_ids, s.generator))
        want_logprobs = any(seqs[i].params.logprobs is not None for i in spec)
        if all(_is_plain_greedy(r) for r in rows) and not want_logprobs:
            argmax, lps = greedy_logprob(logits)
            logp = None
        else:
            x = apply_penalties_and_warpers(logits, rows)
            logp = torch.log_softmax(x, dim=-1)
            argmax = x.argmax(dim=-1)
            lps = None
        touched = {}
        first = 0
        for i in spec:
            s, d = seqs[i], toks[i][1:]
            count = len(d) + 1
            drafted = torch.tensor([d], dtype=torch.long)
            if s.params.temperature < SAMPLING_EPS:
                n_acc, final = greedy_verify(argmax[first:first + count][None], drafted, torch.tensor([len(d)]))
            else:
                probs = logp[first:first + count].exp()[None]
                gen = s.generator
                u = torch.rand(count, dtype=probs.dtype, generator=gen) if gen is not None else \
                    torch.rand(count, dtype=probs.dtype)
                q = drafts[s].probs
                n_acc, final = rejection_sample(probs, drafted, torch.tensor([len(d)]),
                                                q[None] if q is not None else None, u[None, :len(d)], u[len(d):])
            n_acc, final = int(n_acc[0]), int(final[0])
            st.spec_proposed_tokens += len(d)
            st.spec_accepted_tokens += n_acc
            st.spec_verified_seqs += 1
            self._learn(s, len(d), n_acc)
            self._emit(engine, s, d[:n_acc] + [final], first, lps, logp, rows)
            touched[s.request_id] = engine.requests[s.request_id]
            if not s.is_finished:
                s.num_cached = s.num_tokens - 1  # the cache keeps the accepted prefix
                blocks.trim(s, s.num_tokens)
                blocks.commit(s)
            self.proposer.accepted(s, n_before[i], n_acc)
            first += count
        self.sweep()
        return outs + [o for rs in touched.values() if (o := engine._make_output(rs)) is not None]

    @staticmethod
    def _forward(runner, bucket: Bucket, seqs: list[Sequence], toks: list[list[int]]):
        """One target forward: sequence i computes ``toks[i]`` from its cached context on; logits
        of every computed position, ``layout[i] = (first row, rows)``."""
        runner.kv.copy_blocks(runner.blocks.take_pending_copies())
        bs = runner.block_size
        B, T = len(seqs), max(len(t) for t in toks)
        ids = np.zeros((B, T), dtype=np.int64)
        pos = np.zeros((B, T), dtype=np.int64)
        slots = np.zeros((B, T), dtype=np.int64)
        seq_lens = np.ones(B, dtype=np.int64)
        ends = [s.num_cached + len(t) for s, t in zip(seqs, toks)]
        width = -(-max(ends) // bs)
        table = np.zeros((B, width), dtype=np.int64)
        table[:] = runner.blocks.block_tables[np.array([s.slot for s in seqs], dtype=np.int64), :width]
        logits_idx: list[int] = []
        layout = []
        for i, (s, t, end) in enumerate(zip(seqs, toks, ends)):
            q = len(t)
            p = np.arange(s.num_cached, end, dtype=np.int64)
            ids[i, :q] = t
            pos[i, :q] = p
            slots[i, :q] = table[i, p // bs] * bs + p % bs
            seq_lens[i] = end
            layout.append((len(logits_idx), q))
            logits_idx.extend(range(i * T, i * T + q))
            s.num_cached = end
        inputs = runner._tensors(ids, pos, table, slots, seq_lens, np.array(logits_idx, dtype=np.int64))
        # the graphs are shape-dynamic: the decode bucket's serves k + 1 tokens (also in rank workers)
        return runner.run(bucket, inputs), layout

    @staticmethod
    def _emit(engine, s: Sequence, emitted: list[int], first: int, lps, logp, rows) -> None:
        """Append the accepted run to ``s`` token by token (logprobs are the target's), stopping at
        the first token the engine's stop rules end the sequence on."""
        want = s.params.logprobs
        for j, token in enumerate(emitted):
            r = first + j
            if logp is not None:
                lp = float(logp[r, token])
            else:
                lp = float(lps[r])  # plain greedy: the emitted token is the row's argmax
            s.output_token_ids.append(token)
            s.cumulative_logprob += lp
            engine.stats.generated_tokens += 1
            if s.logprobs is not None:
                row = logp[r:r + 1]
                rank = _ranks(row, row[:, token], [rows[r]])[0]
                entry = {token: Logprob(lp, rank, engine._decoded(token))}
                top = _top_logprobs(row, [rows[r]]) if want else None
                if top is not None:
                    for k, (tid, v) in enumerate(top[0][:want], start=1):
                        entry.setdefault(tid, Logprob(v, k, engine._decoded(tid)))
                s.logprobs.append(entry)
            if s.detokenizer is not None:
                s.detokenizer.push([token])
            engine._check_stop(s, token)
            if s.is_finished:
                return
