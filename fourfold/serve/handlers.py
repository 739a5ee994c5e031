"""The generation endpoints: /v1/completions and /v1/chat/completions, streamed (server-sent events) or whole.

Both turn the request into prompt ids and per-choice SamplingParams, check them against the model's
context, take an admission slot, then run the n choices on the engine (fourfold.serve.streams) and shape
the outputs (fourfold.serve.responses). A client that disconnects ends the stream; leaving the stream
aborts its engine requests, so their KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
import weakref
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from fourfold.serve import responses as R
from fourfold.serve.errors import APIError, error_body
from fourfold.serve.metrics import ServerMetrics
from fourfold.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from fourfold.serve.streams import Admission, Slot, merged_outputs


class ClosingStreamingResponse(StreamingResponse):
    """A streamed response that closes its body generator however the response ends.

    When the client disconnects, Starlette stops iterating the body while the generator sits at a
    `yield`; closing it here runs its `finally` blocks at once (aborting the engine requests and freeing
    the admission slot) instead of whenever the garbage collector finds it.
    """

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


@dataclass
class Prepared:
    """A validated request ready for the engine."""

    rid: str
    created: int
    prompt_ids: list[int]
    params: list
    stream: bool
    include_usage: bool
    want_logprobs: bool


class Generation:
    """Runs generation requests for one served model; the app's routes call `completions` and `chat`."""

    def __init__(self, engine, model_name: str, tokenizer, chat_template, max_model_len: int,
                 admission: Admission, metrics: ServerMetrics, timeout_s: float | None):
        self.engine, self.model_name, self.tokenizer, self.template = engine, model_name, tokenizer, chat_template
        self.max_model_len, self.admission, self.metrics, self.timeout_s = max_model_len, admission, metrics, timeout_s

    def _check_model(self, body: SamplingFields) -> None:
        if body.model != self.model_name:
            raise APIError(404, f"The model '{body.model}' does not exist; this server serves '{self.model_name}' "
                                "(see GET /v1/models).", param="model", code="model_not_found")

    def _prepare(self, body: SamplingFields, prompt_ids: list[int], max_tokens: int | None, logprobs: int | None,
                 prefix: str) -> Prepared:
        if not prompt_ids:
            raise APIError(400, "The prompt is empty after tokenization; send at least one token.", param="prompt")
        if any(not isinstance(t, int) or t < 0 or t >= self.tokenizer.vocab_size for t in prompt_ids):
            raise APIError(400, f"Prompt token ids must be in [0, {self.tokenizer.vocab_size}).", param="prompt")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise APIError(400, f"The prompt has {len(prompt_ids)} tokens but the model's context is "
                                f"{self.max_model_len}; shorten the prompt.", param="messages" if prefix == "chatcmpl"
                           else "prompt", code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise APIError(400, f"max_tokens {max_tokens} plus the prompt's {len(prompt_ids)} tokens exceeds the "
                                f"model's context of {self.max_model_len}; ask for at most {room}.",
                           param="max_tokens", code="context_length_exceeded")
        params = [body.sampling_params(max_tokens, logprobs, seed_offset=i) for i in range(body.n)]
        return Prepared(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), prompt_ids, params, body.stream,
                        bool(body.stream_options and body.stream_options.include_usage), logprobs is not None)

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body)
        ids = self.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        prep = self._prepare(body, ids, body.max_tokens, body.logprobs, "cmpl")
        return await self._respond(prep, request, "completions")

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body)
        try:
            logprobs = body.logprobs_count()
        except ValueError as e:
            raise APIError(400, str(e), param="top_logprobs") from None
        text = self.template.render([m.as_template_message() for m in body.messages], add_generation_prompt=True)
        prep = self._prepare(body, self.tokenizer.encode(text), body.requested_max_tokens(), logprobs, "chatcmpl")
        return await self._respond(prep, request, "chat")

    async def _respond(self, prep: Prepared, request: Request, endpoint: str):
        slot = self.admission.admit()  # before the response starts, so a full server answers 429
        if prep.stream:
            body = self._stream(prep, endpoint, slot)
            weakref.finalize(body, slot.release)  # also when the stream is dropped before it starts
            return ClosingStreamingResponse(body, media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return JSONResponse(await self._whole(prep, request, endpoint, slot))
        finally:
            slot.release()

    def _record(self, endpoint: str, start: float, first: float | None, choices: list[R.Choice], prep: Prepared):
        m = self.metrics
        m.prompt_tokens.inc(len(prep.prompt_ids))
        m.e2e.observe(time.monotonic() - start)
        if first is not None:
            m.ttft.observe(first - start)
        for c in choices:
            m.requests.labels(endpoint, c.finish_reason or "abort").inc()

    async def _run(self, prep: Prepared, endpoint: str, slot: Slot):
        """(choice index, output) pairs, with metrics; releases the request's admission slot at the end."""
        start, first, last = time.monotonic(), None, None
        choices = [R.Choice(i) for i in range(len(prep.params))]
        try:
            async for index, out in merged_outputs(self.engine, prep.rid, prep.prompt_ids, prep.params,
                                                   self.timeout_s):
                if out.token_ids:
                    now = time.monotonic()
                    first = first or now
                    if last is not None:
                        self.metrics.itl.observe(now - last)
                    last = now
                    self.metrics.generation_tokens.inc(len(out.token_ids))
                c = choices[index]
                c.text += out.text_delta
                c.token_ids += out.token_ids
                c.logprobs += out.logprobs
                c.finish_reason = out.finish_reason if out.finished else None
                yield index, out, c
        finally:
            slot.release()
            self._record(endpoint, start, first, choices, prep)

    async def _whole(self, prep: Prepared, request: Request, endpoint: str, slot: Slot) -> dict:
        choices: dict[int, R.Choice] = {}

        async def collect():
            async for index, _, c in self._run(prep, endpoint, slot):
                choices[index] = c

        task = asyncio.create_task(collect())
        while not task.done():  # a client that hangs up aborts the work
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                task.cancel()
        await task if not task.cancelled() else None
        if task.cancelled():
            raise APIError(400, "The client closed the connection.", code="client_disconnected")
        ordered = [choices.get(i, R.Choice(i)) for i in range(len(prep.params))]
        shape = R.chat_body if endpoint == "chat" else R.completion_body
        return shape(prep.rid, prep.created, self.model_name, ordered, len(prep.prompt_ids), self.tokenizer.decode,
                     prep.want_logprobs)

    async def _stream(self, prep: Prepared, endpoint: str, slot: Slot):
        chat = endpoint == "chat"
        decode, completion_tokens = self.tokenizer.decode, 0
        try:
            if chat:
                for i in range(len(prep.params)):
                    yield _sse(R.chat_chunk(prep.rid, prep.created, self.model_name, i, {"role": "assistant",
                                                                                         "content": ""},
                                            None, None, prep.include_usage))
            async for index, out, _ in self._run(prep, endpoint, slot):
                completion_tokens += len(out.token_ids)
                reason = out.finish_reason if out.finished else None
                if not out.token_ids and not out.text_delta and reason is None:
                    continue
                if chat:
                    lp = R.chat_logprobs(out.logprobs, decode) if prep.want_logprobs else None
                    delta = {"content": out.text_delta} if out.text_delta or reason is None else {}
                    yield _sse(R.chat_chunk(prep.rid, prep.created, self.model_name, index, delta, reason, lp,
                                            prep.include_usage))
                else:
                    lp = R.completion_logprobs(out.logprobs, decode) if prep.want_logprobs else None
                    yield _sse(R.completion_chunk(prep.rid, prep.created, self.model_name, index, out.text_delta,
                                                  reason, lp, prep.include_usage))
            if prep.include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield _sse(R.usage_chunk(prep.rid, prep.created, self.model_name, obj, len(prep.prompt_ids),
                                         completion_tokens))
        except APIError as e:  # the status line is already sent: report in the stream, as OpenAI does
            self.metrics.rejected.labels(str(e.status)).inc()
            yield _sse(error_body(e.status, e.message, e.param, e.code))
        yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
