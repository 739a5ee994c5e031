"""What a caller hands the inference engine and what it gets back: sampling parameters, outputs, engine stats.

These types are the contract between the engine (`fourfold.infer.engine`, the offline `LLM` API and the
async streaming API) and its callers (`fourfold generate`, `fourfold serve`, benchmarks):

    params = SamplingParams(max_tokens=64, temperature=0.0, stop=["\\n\\n"])
    async for out in engine.generate(request_id, prompt_ids, params):   # one RequestOutput per step
        print(out.text_delta, end="")                                      # out.finished on the last one

Field names follow vLLM's and OpenAI's where they mean the same thing, so the server maps requests
one to one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from fourfold.errors import ConfigError


@dataclass
class SamplingParams:
    """How one request's tokens are chosen and when it stops. temperature 0 is greedy."""

    max_tokens: int = 16
    """New tokens at most; the request also stops when the model's context is full (finish_reason 'length')."""
    temperature: float = 1.0
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; 1 keeps all."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one; 0 keeps all."""
    seed: Optional[int] = None
    """A seed makes this request's sampling reproducible whatever else is in the batch."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """Penalties over the tokens generated so far (OpenAI's presence/frequency, HF's repetition)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: output is cut just before the first one and not included."""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    """None: no logprobs; k >= 0: the chosen token's logprob and the k most likely tokens' at each step."""
    detokenize: bool = True
    """False: outputs carry token ids only (text_delta stays empty) and the engine skips the per-token
    detokenization; stop strings need it True."""

    def check(self) -> None:
        """Raise ConfigError naming the field for a value out of range."""
        rules = [("max_tokens", self.max_tokens >= 1, "at least 1"),
                 ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, "a number >= 0"),
                 ("top_k", self.top_k >= 0, "at least 0 (0 disables it)"),
                 ("top_p", math.isfinite(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
                 ("min_p", math.isfinite(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]"),
                 ("presence_penalty", math.isfinite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
                  "in [-2, 2]"),
                 ("frequency_penalty", math.isfinite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
                  "in [-2, 2]"),
                 ("repetition_penalty", math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                  "a number > 0"),
                 ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "None or in [0, 20]"),
                 ("seed", self.seed is None or 0 <= self.seed < 2**63, "None or in [0, 2^63)")]
        for name, ok, valid in rules:
            if not ok:
                raise ConfigError(f"{name} = {getattr(self, name)!r} is out of range; set it to {valid}.")
        if self.stop and not self.detokenize:
            raise ConfigError(f"stop = {self.stop!r} needs the output text, but detokenize is False; "
                              "set detokenize=True or drop the stop strings.")


@dataclass
class TokenLogprobs:
    """One generated token's logprob and the most likely alternatives at that step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    """(token id, logprob) of the `logprobs` most likely tokens, most likely first."""


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request: the new tokens and text since the last output."""

    request_id: str
    token_ids: list[int]
    """Tokens generated in this step (usually one; none when only the finish is reported)."""
    text_delta: str
    """Text for those tokens, detokenized incrementally (stop strings already cut)."""
    finished: bool = False
    finish_reason: Optional[str] = None
    """'stop' (eos, a stop token or string), 'length' (max_tokens or context full), 'abort'; None until finished."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    """Tokens generated so far, this step's included."""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """One entry per token in token_ids, when the request asked for logprobs."""
    cached_prompt_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    ttft_s: Optional[float] = None
    """On the output carrying a request's first token: seconds from add_request to that token."""
    inter_token_s: Optional[float] = None
    """On later outputs: seconds since this request's previous token."""


@dataclass
class EngineStats:
    """A snapshot of the engine for metrics and health checks."""

    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache since start."""
    prefix_cache_hits: int = 0
    """Of those, tokens found."""
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
