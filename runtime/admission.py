"""Request admission and isolation: what a request must satisfy before it joins the shared batch.

One client's bad request must not fail another's: token ids are checked (type, range against
the model's vocabulary) and a request that can never fit the KV cache is refused when it is
added, with a message naming the sizes, instead of preempting others and failing a whole batch
later. When a step still raises, the engine fails only the requests of that step, each with a
:class:`RequestError` (see ``Engine._fail_batch``). Seeded parallel samples get a generator
each (:func:`child_generator`), so their draws do not depend on how steps interleave them
(preemption, batching).
"""
from __future__ import annotations

import numbers
from typing import Any

import torch


class RequestError(RuntimeError):
    """A request failed while the engine computed a step it was part of; other requests go on."""

    def __init__(self, request_id: str, cause: BaseException, batch_requests: int = 1):
        self.request_id = request_id
        self.cause = cause
        others = f" (with {batch_requests - 1} other request(s) of the same step)" if batch_requests > 1 else ""
        super().__init__(f"request {request_id} failed{others}: {type(cause).__name__}: {cause}")


def check_token_ids(ids: Any, vocab_size: int | None) -> list[int]:
    """``ids`` as a list of ints in ``[0, vocab_size)``; TypeError/ValueError naming the first bad one."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"prompt_token_ids[{i}] must be an int, got {type(t).__name__} {t!r}")
        t = int(t)
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            hi = f"{vocab_size - 1}" if vocab_size is not None else "..."
            raise ValueError(f"prompt_token_ids[{i}] = {t} is outside the model's vocabulary [0, {hi}]")
        out.append(t)
    return out


def check_fits(prompt_len: int, params: Any, blocks: Any, max_context: int) -> None:
    """ValueError when the request can never be served by this KV cache, however empty: its
    prompt plus ``max_tokens`` (times the beam width for beam search, which keeps every beam's
    context at once) needs more blocks than the cache has, or it needs more sequence slots."""
    bs = blocks.block_size
    usable = blocks.num_usable_blocks
    new = params.max_tokens if params.max_tokens is not None else max(1, max_context - prompt_len)
    tokens = prompt_len + new - 1  # the last sampled token is never written to the cache
    per_seq = -(-tokens // bs)
    width = (params.best_of or params.n) if params.use_beam_search else 1
    need = per_seq if width == 1 else prompt_len // bs + width * (per_seq - prompt_len // bs)
    if need > usable:
        what = f"{width} beams of " if width > 1 else ""
        raise ValueError(
            f"request can never fit the KV cache: {what}prompt {prompt_len} + max_tokens {new} tokens need {need} "
            f"blocks of {bs} tokens, the cache has {usable} (raise kv_cache_memory_bytes / "
            f"paged_attention_num_blocks, or lower max_tokens{' or best_of' if width > 1 else ''})")
    samples = params.best_of or params.n
    tables = getattr(blocks, "block_tables", None)
    max_seqs = tables.shape[0] if tables is not None else None
    if max_seqs is not None and samples > max_seqs:
        raise ValueError(f"request asks for {samples} parallel samples (n/best_of), the engine has {max_seqs} "
                         "sequence slots (SchedulerConfig.max_processing_samples)")


def check_bounds(params: Any, vocab_size: int | None) -> None:
    """``prompt_logprobs=-1`` (the whole vocabulary per prompt position) within the logprobs cap."""
    from fxcompiler.sampling_params import limit

    cap = limit("LOGPROBS")
    if params.prompt_logprobs == -1 and cap >= 0 and (vocab_size is None or vocab_size > cap):
        raise ValueError(f"prompt_logprobs=-1 asks for the whole vocabulary ({vocab_size} entries) at every prompt "
                         f"position, more than the limit of {cap} (FXCOMPILER_MAX_LOGPROBS; -1 lifts it)")


def child_generator(seed: int, index: int) -> torch.Generator:
    """The generator of parallel sample ``index`` (> 0) of a request seeded ``seed``: a seed of its
    own (sample 0 keeps ``seed``), so each sample's draws are a function of its own steps only."""
    return torch.Generator().manual_seed((int(seed) + index * 0x9E3779B97F4A7C15) % (1 << 64))
