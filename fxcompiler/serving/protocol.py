"""OpenAI request models (pydantic) and their mapping onto ``SamplingParams``; OpenAI's error body."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..guided_decoding import GuidedDecodingParams
from ..sampling_params import SamplingParams


class OpenAIError(Exception):
    """An error the server answers with OpenAI's body ``{"error": {message, type, param, code}}``."""

    def __init__(self, message: str, status: int = 400, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param = message, status, type_, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's extra structured-output fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_params(self, defaults: dict[str, Any], max_tokens: int | None, logprobs: int | None
                        ) -> SamplingParams:
        """The request's ``SamplingParams``: fields it sets win, then the model's generation_config defaults."""
        def pick(name, fallback):
            v = getattr(self, name)
            return v if v is not None else defaults.get(name, fallback)

        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options is only allowed with stream=true", param="stream_options")
        guided = self.guided_decoding()
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise OpenAIError("logit_bias keys must be token ids", param="logit_bias") from None
        best_of = getattr(self, "best_of", None)
        if best_of is not None and self.stream and best_of != self.n:
            raise OpenAIError("best_of must equal n when streaming (the best completions are known only at the end)",
                              param="best_of")
        try:
            return SamplingParams(
                n=self.n, best_of=best_of, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", -1),
                min_p=pick("min_p", 0.0), repetition_penalty=pick("repetition_penalty", 1.0),
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                logit_bias=bias, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
                stop_token_ids=self.stop_token_ids, seed=self.seed, ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
                guided_decoding=guided)
        except (ValueError, TypeError) as exc:
            first = str(exc).split(" ", 1)[0].rstrip(":,")  # SamplingParams' messages start with the field
            raise OpenAIError(str(exc), param=first if first in type(self).model_fields else None) from None
        except NotImplementedError as exc:
            raise OpenAIError(str(exc), 501, "NotImplementedError") from None

    def ignored_fields(self) -> list[str]:
        """Fields the request sent that this server does not know (vLLM logs them and goes on)."""
        return sorted(self.model_extra or ())

    def guided_decoding(self) -> GuidedDecodingParams | None:
        """``response_format`` (json_object / json_schema) or vLLM's ``guided_*`` fields as one constraint."""
        rf = self.response_format
        chosen: dict[str, Any] = {}
        if rf is not None:
            kind = rf.get("type", "text")
            if kind == "json_object":
                chosen["json_object"] = True
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise OpenAIError("response_format json_schema needs json_schema.schema (a JSON schema object)",
                                      param="response_format")
                chosen["json"] = schema
            elif kind != "text":
                raise OpenAIError(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                                  param="response_format")
        for name, field_ in (("json", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice"),
                             ("grammar", "guided_grammar")):
            value = getattr(self, field_)
            if value is not None:
                chosen[name] = value
        if not chosen:
            return None
        try:
            return GuidedDecodingParams(**chosen)
        except (ValueError, TypeError) as exc:
            raise OpenAIError(str(exc), param="response_format") from None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)  # OpenAI's: generate best_of, return the n most likely
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: per prompt position, in each choice


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template: list-of-parts content joined into one string (text parts only)."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise OpenAIError(f"messages[{i}].content: only text parts are supported", param="messages")
                texts.append(part["text"])
            content = "".join(texts)
        d = m.model_dump(exclude_none=True)
        d["content"] = content or ""
        out.append(d)
    return out
