"""Verification of drafted tokens: greedy matching and exact rejection sampling (Leviathan et al. 2023).

Given the target's distributions ``p_0 .. p_k`` at the positions of ``[last token, d_1 .. d_k]``
and the draft's ``q_1 .. q_k`` that proposed ``d_1 .. d_k``: accept ``d_i`` with probability
``min(1, p_{i-1}(d_i) / q_i(d_i))``; at the first rejection draw the replacement from
``norm(max(0, p - q))`` and stop; when every draft is accepted draw a bonus token from ``p_k``.
The emitted tokens then follow the target's distribution exactly, whatever ``q`` is. A proposer
without a distribution (n-gram lookup) has ``q`` = a point mass on its token: accept with
probability ``p(d)``, on rejection sample from ``p`` with ``d`` removed (vLLM does the same).

Both functions work on whole batches (no per-row Python); rows may have fewer drafts than the
padded width ``k`` (``num_drafts``).
"""
from __future__ import annotations

import torch

__all__ = ["greedy_verify", "rejection_sample", "sample_from"]


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading entries of the boolean ``accept`` [B, k] are True."""
    if accept.shape[1] == 0:
        return torch.zeros(accept.shape[0], dtype=torch.long, device=accept.device)
    return accept.long().cumprod(dim=1).sum(dim=1)


def greedy_verify(target_argmax: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts, final token) per row for greedy requests.

    ``target_argmax`` [B, k+1]: the target's choice after the last token and after each draft;
    ``draft_tokens`` [B, k]; ``num_drafts`` [B]. A draft is accepted while it equals the target's
    choice; the final token is the target's choice right after the accepted run (a correction, or
    the bonus token when all drafts match)."""
    k = draft_tokens.shape[1]
    valid = torch.arange(k, device=draft_tokens.device)[None, :] < num_drafts[:, None]
    n_acc = _accepted_prefix((draft_tokens == target_argmax[:, :k]) & valid)
    final = target_argmax.gather(1, n_acc[:, None]).squeeze(1)
    return n_acc, final


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row of ``probs`` [B, V] (unnormalised is fine) with the
    uniforms ``u`` [B]; zero-probability tokens are never picked."""
    cum = probs.cumsum(dim=-1)
    total = cum[:, -1:]
    target = torch.minimum(u[:, None].to(cum.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cum, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
                     draft_probs: torch.Tensor | None, u_accept: torch.Tensor,
                     u_final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts, final token) per row under the speculative sampling rule.

    ``target_probs`` [B, k+1, V]: the target's processed (filtered, normalised) distributions;
    ``draft_tokens`` [B, k]; ``num_drafts`` [B] (``<= k``); ``draft_probs`` [B, k, V] the
    distributions the drafts were drawn from, or ``None`` for point-mass proposals (n-gram);
    ``u_accept`` [B, k] and ``u_final`` [B]: uniforms in [0, 1) (drawn by the caller, so that
    seeded requests use their own generator). The emitted tokens are
    ``draft_tokens[:n_acc] + [final]``."""
    B, K1, V = target_probs.shape
    k = K1 - 1
    if draft_tokens.shape != (B, k):
        raise ValueError(f"draft_tokens must be [{B}, {k}], got {tuple(draft_tokens.shape)}")
    dev = target_probs.device
    rows = torch.arange(B, device=dev)
    valid = torch.arange(k, device=dev)[None, :] < num_drafts[:, None]
    tok = draft_tokens.clamp(0, V - 1)
    p_d = target_probs[:, :k].gather(2, tok[..., None]).squeeze(2)
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
    else:
        q_d = draft_probs.to(target_probs.dtype).gather(2, tok[..., None]).squeeze(2)
    # accept with probability min(1, p/q): u < p/q  <=>  u * q < p (q > 0 for a drawn token)
    accept = (u_accept.to(p_d.dtype) * q_d < p_d) & valid
    n_acc = _accepted_prefix(accept)
    dist = target_probs[rows, n_acc]  # p at the first rejected draft, or the bonus position
    rejected = n_acc < num_drafts
    if k > 0 and bool(rejected.any()):
        at = n_acc.clamp(max=k - 1)
        if draft_probs is None:
            q = torch.zeros_like(dist)
            q[rows, tok[rows, at]] = 1.0
        else:
            q = draft_probs.to(dist.dtype)[rows, at]
        resid = (dist - q).clamp_min(0.0)
        mass = resid.sum(dim=-1, keepdim=True)
        # mass 0 means p <= q everywhere, i.e. p == q: rejection then has probability 0
        resid = torch.where(mass > 0, resid, dist)
        dist = torch.where(rejected[:, None], resid, dist)
    return n_acc, sample_from(dist, u_final)
