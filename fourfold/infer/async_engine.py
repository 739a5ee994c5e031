"""The async streaming API over LLMEngine: the engine steps in a background thread, callers await deltas.

    engine = AsyncEngine.from_path("runs/tiny")                 # or AsyncEngine(LLMEngine(...))
    async for out in engine.generate("req-1", prompt_ids, SamplingParams(max_tokens=64)):
        print(out.text_delta, end="")                           # one RequestOutput per step
    await engine.abort("req-1")                                 # frees its KV blocks
    engine.stats(); engine.tokenizer; engine.chat_template; engine.max_model_len; engine.model_name

One thread owns the LLMEngine: it takes queued additions and aborts between steps, runs a step when
there is work (sleeps on an event otherwise) and hands each output to its request's asyncio queue
with `loop.call_soon_threadsafe`, so the event loop never waits for a model step. Bad requests
(parameters out of range, a prompt that can never fit) raise ConfigError from `generate` at once. A
consumer that stops iterating early (client disconnect, `break`) aborts its request.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from pathlib import Path
from typing import AsyncIterator

import torch

from fourfold.errors import ConfigError
from fourfold.infer.engine import LLMEngine
from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.loading import load_model
from fourfold.infer.requests import EngineStats, RequestOutput, SamplingParams
from fourfold.infer.sequence import Sequence


class AsyncEngine:
    """Streams RequestOutput deltas from an LLMEngine stepping in a background thread."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: deque = deque()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fourfold-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_path(cls, path: str | Path, device: torch.device | str = "cpu", dtype=None,
                  config: EngineConfig | None = None) -> "AsyncEngine":
        """Load the model at `path` (fourfold.infer.loading.load_model) and start an engine for it."""
        device = torch.device(device)
        loaded = load_model(path, device, dtype)
        return cls(LLMEngine.from_model(loaded.model, loaded.tokenizer, config, device, loaded.kv_heads,
                                        eos_id=loaded.eos_id, model_name=loaded.name,
                                        chat_template=loaded.chat_template))

    # -- what the server needs --------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def chat_template(self):
        return self.engine.chat_template

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters (read without stopping it)."""
        return self.engine.stats()

    # -- requests ---------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs as they come; the last has finished=True."""
        if self._error is not None:
            raise RuntimeError("the engine thread has stopped") from self._error
        params = params or SamplingParams()
        params.check()
        ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if request_id in self._streams:
            raise ConfigError(f"request id {request_id!r} is already in use; give each request its own id.")
        self.engine.scheduler.check_fits(Sequence(request_id, ids, params, 0))
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._command(("add", request_id, ids, params))
        finished = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise RuntimeError("the engine failed while running this request") from out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self._streams.pop(request_id, None)
                self._command(("abort", request_id, None))

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; returns once the engine thread has done it."""
        done = asyncio.get_running_loop().create_future()
        self._command(("abort", request_id, done))
        await done

    def shutdown(self) -> None:
        """Stop the engine thread (requests still running are dropped)."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # -- the engine thread ------------------------------------------------------------------------
    def _command(self, command: tuple) -> None:
        self._commands.append(command)
        self._wake.set()

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, queue = stream
        if isinstance(item, RequestOutput) and item.finished:
            self._streams.pop(request_id, None)
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def _apply_commands(self) -> None:
        while self._commands:
            kind, request_id, *rest = self._commands.popleft()
            if kind == "add":
                ids, params = rest
                try:
                    self.engine.add_request(request_id, ids, params)
                except Exception as e:  # checked before queueing; anything else goes to the caller
                    self._deliver(request_id, e)
            else:
                self.engine.abort_request(request_id)
                done = rest[0]
                if done is not None:
                    done.get_loop().call_soon_threadsafe(lambda f=done: f.done() or f.set_result(None))

    def _run(self) -> None:
        while not self._stopped:
            self._apply_commands()
            if not self.engine.has_unfinished():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except BaseException as e:  # the model failed: every waiting caller gets the error
                self._error = e
                for request_id in list(self._streams):
                    self._deliver(request_id, e)
                return
            for out in outputs:
                self._deliver(out.request_id, out)
