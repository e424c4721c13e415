"""Request output types (furiosa_llm / vLLM-shaped)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Logprob", "CompletionOutput", "RequestOutput"]


@dataclass
class Logprob:
    """Log-probability of one token, with its rank and decoded text when known."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion of a request; ``token_ids`` include the EOS token if generated."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" / "length" / None while running
    stop_reason: int | str | None = None  # stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """All completions of one request at one point in time."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: dict[str, Any] | None = field(default=None)
    error: BaseException | None = field(default=None, repr=False)  # set when the request failed (finished)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, "
            f"prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, "
            f"prompt_logprobs={self.prompt_logprobs}, "
            f"outputs={self.outputs}, "
            f"finished={self.finished}, "
            f"metrics={self.metrics})"
        )
