"""A request's sequence: prompt, generated tokens, sampling state and KV slot."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from fxcompiler.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    index: int  # completion index within the request
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int = -1  # row in the block-table matrix while it holds KV blocks
    num_cached: int = 0  # tokens whose K/V are in the cache
    cumulative_logprob: float = 0.0
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    grammar: Any = None  # structured output: a runtime.structured_output.GrammarState (params.guided_decoding)
    detokenizer: Any = None
    prompt: str | None = None
    pending_forks: int = 0  # parallel samples still to fork from this sequence after its prefill
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks (prefix cache)
    prompt_logprobs: list | None = None
    pending_logits: Any = None  # beam search: this beam's next-token logits, until every beam has them  # collected during prefill when params.prompt_logprobs is set

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose K/V are not in the cache yet (1 for a sequence ready to decode)."""
        return self.num_tokens - self.num_cached

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
