"""Running one HTTP request's n choices on the engine: admission, merged streams, abort on exit, timeouts.

    slot = admission.admit()                                        # 429 with Retry-After when full
    try:
        async for index, out in merged_outputs(engine, rid, prompt_ids, params_per_choice, timeout_s):
            ...
    finally:
        slot.release()

Whatever ends the iteration early (the client disconnecting, a timeout, the server shutting down) aborts
every choice's engine request in a `finally`, so its KV blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

from fourfold.infer.requests import RequestOutput, SamplingParams
from fourfold.serve.errors import APIError


class Slot:
    """One admitted request's place; releasing it twice is harmless."""

    def __init__(self, admission: "Admission"):
        self.admission, self.released = admission, False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.inside -= 1


class Admission:
    """At most `limit` requests inside the server at once; the next one gets 429 and a Retry-After hint."""

    def __init__(self, limit: int, retry_after_s: int = 1):
        self.limit, self.retry_after_s, self.inside = limit, retry_after_s, 0

    def admit(self) -> Slot:
        """A slot for one request, or APIError 429 when the server is full (taken before any response starts)."""
        if self.inside >= self.limit:
            raise APIError(429, f"The server is at its limit of {self.limit} requests in flight; retry shortly.",
                           code="rate_limit_exceeded", headers={"Retry-After": str(self.retry_after_s)})
        self.inside += 1
        return Slot(self)


async def _pump(engine, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams,
                queue: asyncio.Queue) -> None:
    try:
        async for out in engine.generate(request_id, prompt_ids, params):
            await queue.put((index, out))
    except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises
        await queue.put((index, e))
        if isinstance(e, asyncio.CancelledError):
            raise


async def merged_outputs(engine, request_id: str, prompt_ids: list[int], params: list[SamplingParams],
                         timeout_s: float | None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from every choice as they come; aborts the unfinished ones when left early."""
    queue: asyncio.Queue = asyncio.Queue()
    ids = [request_id if len(params) == 1 else f"{request_id}-{i}" for i in range(len(params))]
    tasks = [asyncio.create_task(_pump(engine, rid, i, prompt_ids, p, queue)) for i, (rid, p) in
             enumerate(zip(ids, params))]
    finished = [False] * len(params)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while not all(finished):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise asyncio.TimeoutError
            index, item = await asyncio.wait_for(queue.get(), remaining)
            if isinstance(item, BaseException):
                raise item
            finished[index] = item.finished
            yield index, item
    except asyncio.TimeoutError:
        raise APIError(504, f"The request did not finish within the server's {timeout_s:g} s limit.",
                       code="timeout") from None
    finally:
        for rid, done, task in zip(ids, finished, tasks):
            if not done:
                task.cancel()
                with contextlib.suppress(Exception):
                    await engine.abort(rid)
