"""OpenAI response bodies: completions and chat completions, whole or as streamed chunks, with logprobs and usage.

Pure functions from the engine's RequestOutputs (fourfold.infer.requests) to the JSON objects OpenAI's API
returns, so the handlers only move data and the shapes are tested in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fourfold.infer.requests import TokenLogprobs


@dataclass
class Choice:
    """What one of a request's n choices has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries: list[TokenLogprobs], decode, text_offset: int = 0) -> dict | None:
    """The legacy completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    if not entries:
        return None
    tokens, offsets, position = [], [], text_offset
    for e in entries:
        piece = decode([e.token_id])
        tokens.append(piece)
        offsets.append(position)
        position += len(piece)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{decode([t]): lp for t, lp in e.top} for e in entries], "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprobs], decode) -> dict | None:
    """The chat logprobs object: content = [{token, logprob, bytes, top_logprobs: [...]}]."""
    if not entries:
        return None

    def item(token_id: int, logprob: float) -> dict:
        text = decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_body(rid: str, created: int, model: str, choices: list[Choice], prompt_tokens: int, decode,
                    want_logprobs: bool) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, "text": c.text,
                         "logprobs": completion_logprobs(c.logprobs, decode) if want_logprobs else None,
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices))}


def chat_body(rid: str, created: int, model: str, choices: list[Choice], prompt_tokens: int, decode,
              want_logprobs: bool) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None},
                         "logprobs": chat_logprobs(c.logprobs, decode) if want_logprobs else None,
                         "finish_reason": c.finish_reason} for c in choices],
            "usage": usage(prompt_tokens, sum(len(c.token_ids) for c in choices))}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, finish_reason: str | None,
                     logprobs: dict | None, with_usage_field: bool) -> dict:
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None, with_usage_field: bool) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, created: int, model: str, obj: str, prompt_tokens: int, completion_tokens: int) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, the whole request's usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}
