"""``fxc::greedy_logprob``: the greedy sampler's hot path as one op; ``fxc::apply_token_bitmask``: structured
output's grammar masks applied to the logits.

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


# --- fxc::apply_token_bitmask ------------------------------------------------------------------------------------
# A copy of logits [B, V] in which row rows[j] keeps the tokens bitmask[j] allows (bit t % 32 of int32 word
# t // 32: llguidance's and xgrammar's layout) and holds -inf at every other token. The ATen reference unpacks
# the bits and masked_fills; backends/cpu installs a kernel that blends each row in one pass.
_lib.define("apply_token_bitmask(Tensor logits, Tensor bitmask, Tensor rows) -> Tensor")


def unpack_token_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The bool [rows, vocab] view of an int32 token bitmask (bit t % 32 of word t // 32 = token t)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.to(torch.int32)[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], bitmask.shape[1] * 32)[:, :vocab].bool()


def _check_bitmask_args(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"fxc::apply_token_bitmask: logits must be [B, V], got {tuple(logits.shape)}")
    words = (logits.shape[1] + 31) // 32
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.shape[1] != words:
        raise ValueError(f"fxc::apply_token_bitmask: bitmask must be int32 [R, {words}] for V={logits.shape[1]}, "
                         f"got {bitmask.dtype} {tuple(bitmask.shape)}")
    if rows.dim() != 1 or rows.dtype != torch.long or rows.shape[0] != bitmask.shape[0]:
        raise ValueError(f"fxc::apply_token_bitmask: rows must be int64 [{bitmask.shape[0]}], got "
                         f"{rows.dtype} {tuple(rows.shape)}")


_NEG_INF_BITS = -8388608  # 0xFF800000: float32 -inf as an int32


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    _check_bitmask_args(logits, bitmask, rows)
    if not rows.numel():
        return logits.clone()
    allowed = unpack_token_bitmask(bitmask, logits.shape[1]).to(logits.device)
    every_row = rows.numel() == logits.shape[0] and bool((rows == torch.arange(rows.numel(), device=rows.device)).all())
    sub = logits if every_row else logits[rows]
    if sub.dtype == torch.float32:  # masked_fill's bits by integer select: faster than masked_fill itself
        keep = allowed.to(torch.int32).neg_()  # all ones where allowed
        bits = sub.contiguous().view(torch.int32) & keep
        masked = bits.bitwise_or_(keep.bitwise_not_().bitwise_and_(_NEG_INF_BITS)).view(torch.float32)
    else:
        masked = sub.masked_fill(~allowed, float("-inf"))
    if every_row:
        return masked
    out = logits.clone()
    out[rows] = masked
    return out


_lib.impl("apply_token_bitmask", apply_token_bitmask_reference, "CompositeExplicitAutograd")


@torch.library.register_fake("fxc::apply_token_bitmask", lib=_lib)
def _fake_bitmask(logits, bitmask, rows):
    return torch.empty_like(logits)


apply_token_bitmask = torch.ops.fxc.apply_token_bitmask.default
