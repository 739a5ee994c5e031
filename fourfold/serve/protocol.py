"""OpenAI-compatible request bodies (pydantic) and their translation into the engine's SamplingParams.

Field names and defaults follow OpenAI's API reference for /v1/completions and /v1/chat/completions;
`top_k`, `min_p`, `repetition_penalty` and `ignore_eos` are the usual extensions (vLLM's names). Unknown
fields are ignored, as OpenAI-compatible servers do, but fields we cannot honour (tools, logit_bias, echo,
suffix, best_of other than n) are refused with a 400 naming them rather than silently dropped.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from fourfold.infer.requests import SamplingParams

MAX_N = 8
MAX_STOP_STRINGS = 4


def refuse_if_set(value, info: ValidationInfo):
    """A field this server accepts only when unset or empty (false, null, [], {}): say so, naming it."""
    if value:
        raise ValueError(f"{info.field_name} is not supported by this server")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat requests share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    user: Optional[str] = None
    # Extensions beyond OpenAI's API.
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    ignore_eos: bool = False
    # Accepted only at values that change nothing.
    logit_bias: Optional[dict[str, float]] = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v, info: ValidationInfo):
        return refuse_if_set(v, info)

    def sampling_params(self, max_tokens: int, logprobs: Optional[int], seed_offset: int = 0) -> SamplingParams:
        """The engine's parameters for one of the n choices (each choice gets its own seed when one is set)."""
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              min_p=self.min_p, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              seed=None if self.seed is None else (self.seed + seed_offset) % 2**63,
                              stop=list(self.stop or []), ignore_eos=self.ignore_eos, logprobs=logprobs)


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: Union[str, list[int]]
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v):
        if (isinstance(v, str) and not v) or (isinstance(v, list) and not v):
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported(cls, v, info: ValidationInfo):
        return refuse_if_set(v, info)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def as_template_message(self) -> dict:
        """{"role", "content"} as chat templates expect ("developer" is OpenAI's new name for "system")."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list] = None
    response_format: Optional[dict] = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v, info: ValidationInfo):
        return refuse_if_set(v, info)

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v and v.get("type") not in (None, "text"):
            raise ValueError("only response_format {\"type\": \"text\"} is supported")
        return v

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_count(self) -> Optional[int]:
        """The engine's logprobs setting: None unless logprobs is true; then top_logprobs alternatives."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None
