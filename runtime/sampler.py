"""Vectorised next-token sampler for a batch of requests.

Processing order (matches transformers' logits processors / warpers):

    logit_bias -> min_tokens EOS suppression -> repetition_penalty
    -> presence / frequency penalties (vLLM, output tokens only)
    -> greedy: argmax
    -> else: temperature -> top_k -> top_p -> min_p -> sample from softmax

Everything runs on whole-batch tensors; per-row Python only builds the small
parameter tensors and the (sparse) penalty token counts, and draws seeded
rows' uniforms from their own generator (so a seeded request samples the
same tokens whatever else is in the batch). All-plain-greedy batches take a
fast path: argmax plus the token's log-prob, no copy of the logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from fxcompiler.ops.sampling import greedy_logprob
from fxcompiler.sampling_params import SAMPLING_EPS, SamplingParams

__all__ = ["SamplingRow", "SamplerOutput", "Sampler", "apply_penalties_and_warpers"]

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SamplingRow:
    """One request's sampling state for this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int] = frozenset()  # suppressed while len(output) < min_tokens
    generator: torch.Generator | None = None  # per-request generator when params.seed is set


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # log-prob of the sampled token under the processed distribution
    # (greedy rows: log_softmax of the penalised logits)
    logprobs: list[float]
    # per row top-k (token, logprob), only when some row asked for logprobs > 0
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # per row rank of the sampled token (1 = most likely), only when some row asked for logprobs
    ranks: list[int] | None = None


def _is_plain_greedy(row: SamplingRow) -> bool:
    """True when the row needs nothing but argmax over the raw logits."""
    p = row.params
    return (
        p.temperature < SAMPLING_EPS
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and not p.logit_bias
        and (len(row.output_token_ids) >= p.min_tokens or not row.eos_token_ids)
    )


@dataclass(slots=True)
class _Plan:
    """Per-batch flags gathered in one pass over the rows."""

    greedy: list[bool] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    min_p: list[float] = field(default_factory=list)

    @property
    def any_random(self) -> bool:
        return not all(self.greedy)


def _token_counts(
    token_lists: list[Sequence[int]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse count matrix: unique (list index, token id) pairs and their counts.

    Ids outside [0, vocab) are dropped (they cannot be sampled anyway). Sparse
    so that penalties cost O(tokens) rather than O(batch * vocab).
    """
    lens = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    ids = torch.tensor([t for toks in token_lists for t in toks], dtype=torch.long)
    li = torch.repeat_interleave(torch.arange(len(token_lists)), lens)
    keep = (ids >= 0) & (ids < vocab)
    key, counts = torch.unique(li[keep] * vocab + ids[keep], return_counts=True)
    key, counts = key.to(device), counts.to(device)
    return key // vocab, key % vocab, counts


def _select(x: torch.Tensor, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows ``idx`` of x (a view of x itself when idx covers the whole batch)."""
    if len(idx) == x.shape[0]:
        return x, None
    it = torch.tensor(idx, device=x.device)
    return x[it], it


def _apply_penalties(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """logit_bias, min_tokens EOS suppression, repetition and presence/frequency penalties, in place."""
    B, V = x.shape
    dev, dtype = x.device, x.dtype
    bias_r: list[int] = []
    bias_t: list[int] = []
    bias_v: list[float] = []
    eos_r: list[int] = []
    eos_t: list[int] = []
    rep_rows: list[int] = []
    pen_rows: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            for t, v in p.logit_bias.items():
                if 0 <= t < V:  # out-of-vocab biases are ignored
                    bias_r.append(i)
                    bias_t.append(t)
                    bias_v.append(v)
        if row.eos_token_ids and len(row.output_token_ids) < p.min_tokens:
            for t in row.eos_token_ids:
                if 0 <= t < V:
                    eos_r.append(i)
                    eos_t.append(t)
        if p.repetition_penalty != 1.0:
            rep_rows.append(i)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            pen_rows.append(i)

    if bias_r:
        x.index_put_(
            (torch.tensor(bias_r, device=dev), torch.tensor(bias_t, device=dev)),
            torch.tensor(bias_v, dtype=dtype, device=dev),
            accumulate=True,
        )
    if eos_r:
        x[torch.tensor(eos_r, device=dev), torch.tensor(eos_t, device=dev)] = _NEG_INF

    if rep_rows:
        # transformers RepetitionPenaltyLogitsProcessor over prompt + output tokens
        toks = [list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids) for i in rep_rows]
        li, tok, _ = _token_counts(toks, V, dev)
        r = torch.tensor(rep_rows, device=dev)[li]
        pen = torch.tensor([rows[i].params.repetition_penalty for i in rep_rows], dtype=dtype, device=dev)[li]
        vals = x[r, tok]
        x[r, tok] = torch.where(vals < 0, vals * pen, vals / pen)

    if pen_rows:
        # vLLM presence/frequency penalties over output tokens only
        li, tok, counts = _token_counts([rows[i].output_token_ids for i in pen_rows], V, dev)
        r = torch.tensor(pen_rows, device=dev)[li]
        freq = torch.tensor([rows[i].params.frequency_penalty for i in pen_rows], dtype=dtype, device=dev)[li]
        pres = torch.tensor([rows[i].params.presence_penalty for i in pen_rows], dtype=dtype, device=dev)[li]
        vals = x[r, tok]
        vals = vals - freq * counts.to(dtype)
        x[r, tok] = vals - pres  # presence: every token that occurred (count > 0)


def _plan(rows: Sequence[SamplingRow], vocab: int) -> _Plan:
    plan = _Plan()
    for row in rows:
        p = row.params
        g = p.temperature < SAMPLING_EPS
        plan.greedy.append(g)
        # neutral values for greedy rows so batched warpers leave them untouched
        plan.temperature.append(1.0 if g else p.temperature)
        plan.top_k.append(vocab if g or p.top_k < 0 else min(p.top_k, vocab))
        plan.top_p.append(1.0 if g else p.top_p)
        plan.min_p.append(0.0 if g else p.min_p)
    return plan


def _apply_warpers(x: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """temperature -> top_k -> top_p -> min_p (transformers warper semantics), in place."""
    B, V = x.shape
    dev, dtype = x.device, x.dtype
    if any(t != 1.0 for t in plan.temperature):
        x.div_(torch.tensor(plan.temperature, dtype=dtype, device=dev)[:, None])

    limited = [k for k in plan.top_k if k < V]
    if limited:
        kmax = max(limited)
        k = torch.tensor(plan.top_k, device=dev)
        kth = torch.topk(x, kmax, dim=-1).values.gather(1, (k.clamp(max=kmax) - 1)[:, None])
        x.masked_fill_((x < kth) & (k < V)[:, None], _NEG_INF)

    tp_rows = [i for i, p in enumerate(plan.top_p) if p < 1.0]
    if tp_rows:
        x = _top_p(x, tp_rows, [plan.top_p[i] for i in tp_rows], [plan.top_k[i] for i in tp_rows])

    if any(m > 0.0 for m in plan.min_p):
        probs = x.softmax(dim=-1)
        top = probs.amax(dim=-1, keepdim=True)
        remove = probs < torch.tensor(plan.min_p, dtype=dtype, device=dev)[:, None] * top
        remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
        x.masked_fill_(remove, _NEG_INF)
    return x


# top_p candidate-slice size; a full-vocabulary sort is only done when these
# do not hold enough probability mass (or the vocabulary is small).
_TOP_P_CANDIDATES = 256
# slack (in probability) keeping the candidate shortcut clear of float rounding
_TOP_P_SLACK = 1e-4


def _top_p(x: torch.Tensor, rows: list[int], top_p: list[float], top_k: list[int]) -> torch.Tensor:
    """transformers TopPLogitsWarper on ``rows``: drop ascending-sorted tokens whose
    cumulative prob is <= 1 - top_p, always keeping the most likely one.

    Sorting the whole vocabulary dominates sampling cost, so two shortcuts use a
    small descending ``topk`` slice instead, falling back to the full sort:
    * top_k already left at most k finite logits: the -inf rest has zero mass,
      so the cumulative sums are unchanged;
    * the top ``_TOP_P_CANDIDATES`` tokens hold clearly more than ``top_p`` of the
      mass: every token outside them is removed anyway, and inside them the
      ascending cumulative sum is (mass outside) + running sum.
    """
    V = x.shape[1]
    sub, it = _select(x, rows)
    thr = torch.tensor([1.0 - p for p in top_p], dtype=x.dtype, device=x.device)[:, None]
    cum = None
    m = max(top_k) + 1  # one extra slot to detect ties at the k-th value
    if m * 4 <= V:
        vals, idx = torch.topk(sub, m, dim=-1)
        if not bool((vals[:, -1] > _NEG_INF).any()):
            vals, idx = vals.flip(-1), idx.flip(-1)  # ascending, as transformers sorts
            cum = vals.softmax(dim=-1).cumsum(dim=-1)
    if cum is None and _TOP_P_CANDIDATES * 8 <= V:
        vals, idx = torch.topk(sub, _TOP_P_CANDIDATES, dim=-1)
        probs = sub.softmax(dim=-1)
        inside = probs.gather(1, idx).flip(-1)
        outside = (1.0 - inside.sum(dim=-1, keepdim=True)).clamp_min(0.0)
        if bool((outside <= thr - _TOP_P_SLACK).all()):
            vals, idx = vals.flip(-1), idx.flip(-1)
            cum = outside + inside.cumsum(dim=-1)
            sub = torch.full_like(sub, _NEG_INF)  # everything outside the slice is removed
    if cum is None:
        vals, idx = torch.sort(sub, descending=False)
        cum = vals.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= thr
    remove[..., -1:] = False
    sub = sub.scatter(1, idx, vals.masked_fill(remove, _NEG_INF))
    if it is None:
        return sub
    x[it] = sub
    return x


def _working_copy(logits: torch.Tensor) -> torch.Tensor:
    dtype = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    return logits.to(dtype=dtype, copy=True)


def _process(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[torch.Tensor, _Plan]:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows), V], got {tuple(logits.shape)} for {len(rows)} rows")
    x = _working_copy(logits)
    _apply_penalties(x, rows)
    plan = _plan(rows, x.shape[1])
    if plan.any_random:
        x = _apply_warpers(x, plan)
    return x, plan


@torch.no_grad()
def apply_penalties_and_warpers(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Processed logits the sampler draws from (greedy rows: penalised logits only)."""
    return _process(logits, rows)[0]


def _top_logprobs(logp: torch.Tensor, rows: Sequence[SamplingRow]) -> list[list[tuple[int, float]]] | None:
    ks = [row.params.logprobs or 0 for row in rows]
    kmax = min(max(ks, default=0), logp.shape[1])
    if kmax <= 0:
        return None
    vals, idx = torch.topk(logp, kmax, dim=-1)
    vals_l, idx_l = vals.tolist(), idx.tolist()
    return [
        [(t, v) for t, v in zip(idx_l[i][:k], vals_l[i][:k]) if v != _NEG_INF]
        for i, k in enumerate(ks)
    ]


def _ranks(logp: torch.Tensor, lps: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int] | None:
    if not any(row.params.logprobs is not None for row in rows):
        return None
    return ((logp > lps[:, None]).sum(dim=-1) + 1).tolist()


class Sampler:
    """Picks one token per row from ``logits`` [B, V] with ``B == len(rows)``."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if not logits.requires_grad and all(_is_plain_greedy(r) for r in rows):
            return self._greedy_fast(logits, rows)  # records nothing for autograd: no no_grad context per step
        with torch.no_grad():
            return self._sample_rows(logits, rows)

    def _sample_rows(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        x, plan = _process(logits, rows)
        logp = torch.log_softmax(x, dim=-1)
        if plan.any_random:
            tokens = self._sample(x, logp, rows, plan)
        else:
            tokens = x.argmax(dim=-1)
        lps = logp.gather(1, tokens[:, None]).squeeze(1)
        return SamplerOutput(tokens.tolist(), lps.tolist(), _top_logprobs(logp, rows), _ranks(logp, lps, rows))

    @staticmethod
    def _greedy_fast(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Hot path: argmax plus its log-prob, no copies of the logits."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows), V], got {tuple(logits.shape)} for {len(rows)} rows")
        if any(r.params.logprobs is not None for r in rows):
            x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
            _, tokens = x.max(dim=-1)
            logp = torch.log_softmax(x, dim=-1)
            lps = logp.gather(1, tokens[:, None]).squeeze(1)
            return SamplerOutput(tokens.tolist(), lps.tolist(), _top_logprobs(logp, rows), _ranks(logp, lps, rows))
        tokens, lps = greedy_logprob(logits)  # one kernel over the logits where a backend installs one
        return SamplerOutput(tokens.tolist(), lps.tolist(), None)

    @staticmethod
    def _sample(x: torch.Tensor, logp: torch.Tensor, rows: Sequence[SamplingRow], plan: _Plan) -> torch.Tensor:
        """Inverse-CDF sampling: one uniform per row, first token whose cumulative prob exceeds it.

        Unseeded rows share one batch draw; seeded rows draw their uniform from
        their own generator, so the result does not depend on the batch. Zero-prob
        tokens are never picked (their cumulative sum does not increase).
        """
        B = x.shape[0]
        cum = torch.softmax(x, dim=-1).cumsum(dim=-1)  # = logp.exp(), without exp's slow path for -inf
        u = torch.rand(B, 1, dtype=cum.dtype, device=cum.device)
        for i, row in enumerate(rows):
            if row.generator is not None and not plan.greedy[i]:
                u[i] = torch.rand(1, dtype=cum.dtype, generator=row.generator, device=row.generator.device)
        total = cum[:, -1:]
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        sampled = torch.searchsorted(cum, target, right=True).squeeze(1).clamp_(max=x.shape[1] - 1)
        if any(plan.greedy):
            greedy = torch.tensor(plan.greedy, device=x.device)
            sampled = torch.where(greedy, x.argmax(dim=-1), sampled)
        return sampled
