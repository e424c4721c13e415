"""``fxc::greedy_logprob``: the greedy sampler's hot path as one op.

For logits ``[B, V]`` it returns the index of each row's maximum (the first one on ties; NaN
counts as the maximum, as in ``torch.max``) and its log-probability ``max - logsumexp(row)``.
The ATen reference is four reductions over the logits (max, then logsumexp's amax, sub, exp,
sum); ``backends/cpu`` installs a kernel that does it in two passes over each row.
"""
from __future__ import annotations

import torch

_lib = torch.library.Library("fxc", "FRAGMENT")
_lib.define("greedy_logprob(Tensor logits) -> (Tensor, Tensor)")


def greedy_logprob_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() != 2:
        raise ValueError(f"fxc::greedy_logprob: logits must be [B, V], got {tuple(logits.shape)}")
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    vals, tokens = x.max(dim=-1)
    return tokens, vals - torch.logsumexp(x, dim=-1)


_lib.impl("greedy_logprob", greedy_logprob_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("fxc::greedy_logprob", lib=_lib)
def _fake(logits):
    dt = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    return logits.new_empty(logits.shape[0], dtype=torch.long), logits.new_empty(logits.shape[0], dtype=dt)


greedy_logprob = torch.ops.fxc.greedy_logprob.default
