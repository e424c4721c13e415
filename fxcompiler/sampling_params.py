"""Sampling parameters (furiosa_llm / vLLM 0.6.2-compatible).

``SamplingParams`` only validates and normalises values; which of them a
runtime actually supports (n > 1, beam search, logprobs, ...) is decided by
the runtime, not here.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, fields
from typing import Any, Literal

from .guided_decoding import GuidedDecodingParams

__all__ = ["RequestOutputKind", "SamplingType", "SamplingParams", "SAMPLING_EPS"]

# Temperatures below this are treated as greedy decoding (vLLM convention).
SAMPLING_EPS = 1e-5

# Bounds on the work one request may ask for (docs/security.md "Bounds"): each is checked with
# an error naming the field and the cap. Override a cap with the environment variable
# FXCOMPILER_MAX_<NAME> (e.g. FXCOMPILER_MAX_LOGPROBS=100) when a deployment needs more.
LIMITS: dict[str, int] = {
    "LOGPROBS": 20,  # logprobs and prompt_logprobs (top-k per position; -1 = the vocabulary size, checked by the engine)
    "SAMPLES": 64,  # n and best_of (parallel samples / beam width)
    "STOP_STRINGS": 64,  # entries of stop
    "STOP_STRING_CHARS": 1024,  # characters of one stop string
    "STOP_TOKEN_IDS": 1024,  # entries of stop_token_ids
    "LOGIT_BIAS": 1024,  # entries of logit_bias (OpenAI allows 300)
    "INPUTS": 2048,  # texts of one embeddings / score / rerank request (OpenAI's embeddings limit)
}


def limit(name: str) -> int:
    """The cap ``name`` of :data:`LIMITS`, or ``$FXCOMPILER_MAX_<name>`` when set (an int)."""
    import os

    env = os.environ.get(f"FXCOMPILER_MAX_{name}")
    if env is not None:
        try:
            return int(env)
        except ValueError:
            raise ValueError(f"FXCOMPILER_MAX_{name} must be an int, got {env!r}") from None
    return LIMITS[name]


class RequestOutputKind(enum.IntEnum):
    """How much of the output each streamed ``RequestOutput`` carries."""

    CUMULATIVE = 0  # whole text so far
    DELTA = 1  # only the new part
    FINAL_ONLY = 2  # one output when finished
    FINAL = 2  # alias of FINAL_ONLY (furiosa name)


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    BEAM = 2


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(kw_only=True)
class SamplingParams:
    """Per-request sampling configuration; validated in ``__post_init__``."""

    # furiosa_llm (v2025.2) fields
    n: int = 1
    best_of: int | None = None
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM / furiosa 2026.x fields
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    guided_decoding: GuidedDecodingParams | None = None  # structured output (docs/serving.md)

    # ------------------------------------------------------------------ init
    def __post_init__(self) -> None:
        self._normalise()
        self._verify_args()
        if self.use_beam_search:
            self._verify_beam_search()
        else:
            self._verify_non_beam_search()
            if self.temperature < SAMPLING_EPS:
                # Warpers are meaningless for greedy decoding (vLLM resets them).
                self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0
                self._verify_greedy_sampling()

    def _normalise(self) -> None:
        """Coerce types and fill derived defaults before range checks."""
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise TypeError(f"{name} must be an int, got {getattr(self, name)!r}")
        if self.top_k == 0:  # vLLM's spelling of "no top-k" (as -1)
            self.top_k = -1
        for name in ("best_of", "max_tokens", "seed", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not _is_int(v):
                raise TypeError(f"{name} must be an int or None, got {v!r}")
        for name in (
            "repetition_penalty", "temperature", "top_p", "min_p",
            "length_penalty", "presence_penalty", "frequency_penalty",
        ):
            v = getattr(self, name)
            if not _is_real(v):
                raise TypeError(f"{name} must be a float, got {v!r}")
            setattr(self, name, float(v))
        for name in ("use_beam_search", "include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

        if self.best_of is None:
            self.best_of = self.n
        if self.seed == -1:
            self.seed = None
        if self.logprobs is True:
            self.logprobs = 1
        elif self.logprobs is False:
            self.logprobs = None
        elif self.logprobs is not None and not _is_int(self.logprobs):
            raise TypeError(f"logprobs must be an int, bool or None, got {self.logprobs!r}")

        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except (ValueError, TypeError):
            raise ValueError(
                f"output_kind must be one of {[k.name for k in RequestOutputKind]}, got {self.output_kind!r}"
            ) from None

        if self.stop is None:
            stop: list[str] = []
        elif isinstance(self.stop, str):
            stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            stop = list(self.stop)
        else:
            raise TypeError(f"stop must be a str, a list of str or None, got {self.stop!r}")
        if any(not s for s in stop):  # vLLM's rule: "" would match at once
            raise ValueError(f"stop cannot contain an empty string, got {self.stop!r}")
        self.stop = stop

        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)) and all(_is_int(t) for t in self.stop_token_ids):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise TypeError(f"stop_token_ids must be a list of int or None, got {self.stop_token_ids!r}")

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"logit_bias must be a dict[int, float] or None, got {self.logit_bias!r}")
            if len(self.logit_bias) > limit("LOGIT_BIAS"):
                raise ValueError(f"logit_bias has {len(self.logit_bias)} entries, at most {limit('LOGIT_BIAS')} "
                                 "are allowed (FXCOMPILER_MAX_LOGIT_BIAS)")
            bias: dict[int, float] = {}
            for k, v in self.logit_bias.items():
                try:
                    tok = int(k)  # OpenAI clients send string keys
                except (TypeError, ValueError):
                    raise TypeError(f"logit_bias keys must be token ids, got {k!r}") from None
                if not _is_real(v) or math.isnan(v):
                    raise TypeError(f"logit_bias values must be floats, got {v!r} for token {k!r}")
                bias[tok] = float(v)
            self.logit_bias = bias or None

    def _verify_bounds(self) -> None:
        """The caps of :data:`LIMITS` (each error names the field, the cap and its variable)."""
        cap = limit("SAMPLES")
        for name in ("n", "best_of"):
            v = getattr(self, name)
            if v is not None and v > cap:
                raise ValueError(f"{name}={v} exceeds the limit of {cap} parallel samples per request "
                                 "(FXCOMPILER_MAX_SAMPLES)")
        cap = limit("LOGPROBS")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and cap >= 0 and v > cap:  # prompt_logprobs=-1: checked against the vocabulary
                raise ValueError(f"{name}={v} exceeds the limit of {cap} log-probabilities per position "
                                 "(FXCOMPILER_MAX_LOGPROBS)")
        if len(self.stop) > limit("STOP_STRINGS"):
            raise ValueError(f"stop has {len(self.stop)} strings, at most {limit('STOP_STRINGS')} are allowed "
                             "(FXCOMPILER_MAX_STOP_STRINGS)")
        longest = max((len(x) for x in self.stop), default=0)
        if longest > limit("STOP_STRING_CHARS"):
            raise ValueError(f"a stop string has {longest} characters, at most {limit('STOP_STRING_CHARS')} are "
                             "allowed (FXCOMPILER_MAX_STOP_STRING_CHARS)")
        if self.stop_token_ids is not None and len(self.stop_token_ids) > limit("STOP_TOKEN_IDS"):
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} entries, at most "
                             f"{limit('STOP_TOKEN_IDS')} are allowed (FXCOMPILER_MAX_STOP_TOKEN_IDS)")
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 64):
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")

    def _verify_args(self) -> None:
        """Range checks; every message names the field and the allowed range."""
        if self.guided_decoding is not None:
            if not isinstance(self.guided_decoding, GuidedDecodingParams):
                raise TypeError(f"guided_decoding must be a GuidedDecodingParams or None, "
                                f"got {type(self.guided_decoding).__name__}")
            if self.use_beam_search:
                raise NotImplementedError("guided_decoding with use_beam_search: beams share no grammar state yet")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.best_of < self.n:
            raise ValueError(
                f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}."
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be None or >= 0, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise ValueError(
                f"prompt_logprobs must be None, -1 (full vocabulary) or >= 0, got {self.prompt_logprobs}."
            )
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False, or 'never', got {self.early_stopping!r}.")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}.")
        self._verify_bounds()

    def _verify_beam_search(self) -> None:
        if self.best_of <= 1:
            raise ValueError(f"best_of must be greater than 1 when using beam search, got {self.best_of}.")

    def _verify_non_beam_search(self) -> None:
        if self.early_stopping is not False:
            raise ValueError(
                "early_stopping is not effective and must be False when not using beam search, "
                f"got {self.early_stopping!r}."
            )
        if abs(self.length_penalty - 1.0) > SAMPLING_EPS:
            raise ValueError(
                "length_penalty is not effective and must be the default value of 1.0 when not using "
                f"beam search, got {self.length_penalty}."
            )

    def _verify_greedy_sampling(self) -> None:
        if self.best_of > 1:
            raise ValueError(f"best_of must be 1 when using greedy sampling (temperature 0), got {self.best_of}.")

    # ------------------------------------------------------------ accessors
    @property
    def sampling_type(self) -> SamplingType:
        if self.use_beam_search:
            return SamplingType.BEAM
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    def clone(self) -> "SamplingParams":
        """Deep copy (logit_bias / stop lists are not shared)."""
        return copy.deepcopy(self)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> "SamplingParams":
        """Build from keyword arguments where ``None`` means "use the default".

        Fields whose default is ``None`` keep ``None``; unknown names raise TypeError.
        """
        names = {f.name for f in fields(cls) if f.init}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unexpected SamplingParams field(s): {sorted(unknown)}")
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    def verify_and_finalize_max_tokens(self, prompt_len: int, max_prompt_len: int, max_context_len: int) -> None:
        """Check the request fits the model; fill ``max_tokens`` when None.

        Raises ValueError with OpenAI-style messages.
        """
        if prompt_len > max_prompt_len:
            raise ValueError(
                f"This model's maximum input context length is {max_prompt_len} tokens. "
                f"However, your prompt resulted in {prompt_len} tokens. "
                "Please reduce the length of the prompt."
            )
        if self.max_tokens is None:
            remaining = max_context_len - prompt_len
            if remaining < 1:
                raise ValueError(
                    f"This model's maximum context length is {max_context_len} tokens. "
                    f"However, you requested {prompt_len + 1} tokens ({prompt_len} in the prompt, "
                    "1 for the completion). Please reduce the length of the prompt."
                )
            self.max_tokens = remaining
        total = prompt_len + self.max_tokens
        if total > max_context_len:
            raise ValueError(
                f"This model's maximum context length is {max_context_len} tokens. "
                f"However, you requested {total} tokens ({prompt_len} in the prompt, "
                f"{self.max_tokens} for the completion). "
                "Please reduce the length of the prompt or completion."
            )
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
