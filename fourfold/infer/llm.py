"""The offline batch API: `LLM(model).generate(prompts, params)` runs every prompt to completion.

    llm = LLM("runs/tiny")                                        # a run or checkpoint directory
    results = llm.generate(["def add(", "class Stack"], SamplingParams(max_tokens=64, temperature=0))
    for r in results:
        print(r.text, r.finish_reason)

Prompts are text or token-id lists; `params` is one SamplingParams for all or a list, one per prompt.
All requests go into one LLMEngine at once, so continuous batching and prefix caching apply; results
come back in prompt order. A rich progress bar counts finished requests and generated tokens/s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from fourfold.infer.engine import LLMEngine
from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.loading import load_model
from fourfold.infer.requests import SamplingParams, TokenLogprobs


@dataclass
class CompletionResult:
    """One prompt's finished generation."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    cached_prompt_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class LLM:
    """A model and an engine for offline generation."""

    def __init__(self, model: str | Path | nn.Module, tokenizer=None, *, device: str | torch.device = "auto",
                 dtype=None, config: EngineConfig | None = None, **config_fields):
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        config = config or EngineConfig(**config_fields)
        if isinstance(model, nn.Module):
            if tokenizer is None:
                raise ValueError("pass the tokenizer with a model object")
            self.engine = LLMEngine.from_model(model, tokenizer, config, device)
        else:
            loaded = load_model(model, device, dtype)
            self.engine = LLMEngine.from_model(loaded.model, loaded.tokenizer, config, device, loaded.kv_heads,
                                               eos_id=loaded.eos_id, model_name=loaded.name,
                                               chat_template=loaded.chat_template)
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Give the engine's GPU memory back now (LLMEngine.close); `with LLM(...) as llm:` calls it on exit."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: str | list, params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = True) -> list[CompletionResult]:
        """Generate for every prompt (text or token ids); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, per_prompt):
            rid = f"llm-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(rid, prompt, p)
            ids.append(rid)
        results = {rid: CompletionResult(self.engine.requests[rid].seq.prompt_ids, [], "", None) for rid in ids}
        columns = [TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                   TimeElapsedColumn()]
        with Progress(*columns, disable=not progress, transient=True) as bar:
            task = bar.add_task("generate", total=len(ids), rate="")
            tokens = 0
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    r = results[out.request_id]
                    r.token_ids += out.token_ids
                    r.text += out.text_delta
                    r.logprobs += out.logprobs
                    tokens += len(out.token_ids)
                    if out.finished:
                        r.finish_reason, r.cached_prompt_tokens = out.finish_reason, out.cached_prompt_tokens
                        bar.advance(task)
                elapsed = bar.tasks[0].elapsed or 0.0
                bar.update(task, rate=f"{tokens / elapsed:.1f} tok/s" if elapsed > 0 else "")
        return [results[rid] for rid in ids]
