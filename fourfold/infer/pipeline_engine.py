"""Pipeline-parallel inference with micro-batched requests: while stage 1 runs one micro-batch, stage 0 runs the next.

    engine = open_pipeline_engine(chunk, tokenizer, EngineConfig(), device, kv_heads, stage_ranks=[0, 1],
                                  group=dist.group.WORLD, sampling_seed=0)
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=32)); engine.step() ...

Every rank holds one stage of the model and runs the same engine. The requests are split into S
micro-batches (S = number of stages), each a virtual engine (an LLMEngine with its own scheduler, its own
requests and its own share of the KV pool, as vLLM's virtual engines); a new request joins the micro-batch
with the fewest requests, and a micro-batch about to be scheduled with nothing waiting takes the newest
not yet started request of the longest queue. `step()` is one tick. At tick t every rank schedules
micro-batch t mod S (the same decisions everywhere: same requests, same sampled tokens), and stage s runs
the step scheduled at tick t - s, so with S = 3 stages and micro-batches A, B, C (A1: A's second step):

    tick              0    1    2    3    4    5    6
    scheduled         A0   B0   C0   A1   B1   C1   A2
    stage 0 runs      A0   B0   C0   A1   B1   C1   A2
    stage 1 runs           A0   B0   C0   A1   B1   C1
    stage 2 runs                A0   B0   C0   A1   B1     then samples
    tokens known                A0   B0   C0   A1   B1     (end of the tick, on every rank)

A micro-batch's next step is scheduled at the tick right after its tokens are known, so from tick S - 1
on every stage works at every tick. A stage sends its hidden states (1, T, dim) to the next one without
waiting (isend, fourfold.infer.pipeline_runner.StageLink) and posts the receive of its next input before it
computes. Only the last stage samples; it broadcasts the sampled ids (and the logprobs rows asked for,
one float64 tensor) instead of the logits, and every rank applies them to its copy of the micro-batch's
requests, so the ranks' schedulers stay identical without sending the schedule. The KV pool is split in
S equal shares, so a request must fit in one share and prefix-cache hits are found within its
micro-batch. Greedy tokens equal those of one process; with fewer busy micro-batches than stages (a
ragged end) the idle ticks are bubbles. `EngineConfig.pipeline_micro_batching = False` gives the
plain pipeline instead (LLMEngine over fourfold.infer.pipeline_runner.PipelineRunner, one step in flight).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fourfold.errors import ConfigError
from fourfold.infer.engine import PLACEHOLDER, LLMEngine, pool_for
from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.kv_pool import KVPool
from fourfold.infer.model_runner import ModelRunner
from fourfold.infer.paged_attention import PagedStep
from fourfold.infer.pipeline_runner import StageLink
from fourfold.infer.requests import EngineStats, RequestOutput, TokenLogprobs
from fourfold.infer.step_tensors import StepTensors


class PoolShare(KVPool):
    """Blocks start .. start + count of a larger pool (the last of them its own scratch block), as a pool."""

    def __init__(self, pool: KVPool, start: int, count: int):  # a view: no memory of its own
        self.num_blocks, self.block_size, self.first_layer = count, pool.block_size, pool.first_layer
        self.keys = pool.keys[:, start:start + count + 1]
        self.values = pool.values[:, start:start + count + 1]


def split_pool(pool: KVPool, parts: int) -> list[KVPool]:
    """`parts` equal shares of `pool`, each with its own scratch block."""
    size = (pool.num_blocks + 1) // parts
    if size < 2:
        raise ConfigError(f"The KV pool ({pool.num_blocks} blocks) is too small to give each of the {parts} "
                          "pipeline micro-batches a block; give the KV cache more memory.")
    return [PoolShare(pool, i * size, size - 1) for i in range(parts)]


@dataclass
class _Step:
    """A micro-batch step from its schedule to its sampled tokens."""

    engine: LLMEngine
    st: StepTensors
    reqs: list = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    """Output slot of each sampling sequence's placeholder token."""
    sampled: torch.Tensor | None = None
    """On the last stage: ids (and logprob columns) packed as `_pack` lays them out."""


def open_pipeline_engine(model: nn.Module, tokenizer, cfg: EngineConfig | None, device: torch.device,
                         kv_heads: int | None, stage_ranks: list[int], group: dist.ProcessGroup,
                         sampling_seed: int = 0, **kwargs):
    """This rank's engine for pipeline stage `model` (a chunk from load_model(pp=...)): micro-batched
    (PipelineEngine) unless `cfg.pipeline_micro_batching` is off (then LLMEngine with one step in flight)."""
    cfg = cfg or EngineConfig()
    if not cfg.pipeline_micro_batching:
        return LLMEngine.from_model(model, tokenizer, cfg, device, kv_heads, group=group,
                                    pipeline_ranks=stage_ranks, sampling_seed=sampling_seed, **kwargs)
    dtype = next(model.parameters()).dtype
    pool = pool_for(model, cfg, device, kv_heads or model.cfg.n_kv_heads, dtype, group)
    max_len = min(cfg.max_model_len or model.cfg.max_seq_len, model.cfg.max_seq_len)
    engines = [LLMEngine(ModelRunner(model, share, device, fuse=False), tokenizer, cfg, max_len,
                         sampling_seed=sampling_seed, **kwargs) for share in split_pool(pool, len(stage_ranks))]
    return PipelineEngine(engines, model, StageLink(stage_ranks, group, device))


class PipelineEngine:
    """The micro-batched pipeline: S virtual engines, one tick per `step()` (see the module docstring)."""

    def __init__(self, engines: list[LLMEngine], model: nn.Module, link: StageLink):
        self.engines, self.model, self.link = engines, model, link
        self.num_stages = len(link.stage_ranks)
        self.stage, self.last = link.stage, link.last
        self.tick = 0
        self.flight: dict[int, _Step | None] = {}
        """Steps scheduled at tick t whose tokens are not known yet (None: that tick scheduled nothing)."""
        self.owner: dict[str, LLMEngine] = {}
        self.moved = 0
        """Waiting requests moved to a micro-batch with nothing waiting (`_take_waiting`)."""
        first = engines[0]
        self.tokenizer, self.max_model_len, self.eos_id = first.tokenizer, first.max_model_len, first.eos_id
        self.model_name, self.chat_template, self.cfg = first.model_name, first.chat_template, first.cfg
        self.scheduler = first.scheduler  # check_fits: every share has the same size

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params=None) -> None:
        """Queue a request in the micro-batch with the fewest requests (the first such one)."""
        if request_id in self.owner:
            raise ConfigError(f"request id {request_id!r} is already in use; give each request its own id.")
        engine = min(self.engines, key=lambda e: len(e.requests))
        engine.add_request(request_id, prompt, params)
        self.owner[request_id] = engine

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its last output comes with the next step (a step in flight still runs)."""
        engine = self.owner.pop(request_id, None)
        if engine is not None:
            engine.abort_request(request_id)

    @property
    def requests(self) -> dict:
        """Unfinished requests by id, from every micro-batch."""
        return {rid: e.requests[rid] for rid, e in self.owner.items() if rid in e.requests}

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines) or any(s is not None for s in self.flight.values())

    # -- ticks ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One tick: schedule a micro-batch, run this stage's step, apply the step whose tokens came out."""
        t, s = self.tick, self.stage
        self.tick += 1
        outputs: list[RequestOutput] = []
        for e in self.engines:
            outputs += e._aborted
            e._aborted = []
        engine = self.engines[t % self.num_stages]
        self._take_waiting(engine)
        self.flight[t] = self._schedule(engine)
        if s > 0 and self.flight.get(t + 1 - s) is not None:  # the next tick's input may come in meanwhile
            self.link.post_receive(t + 1 - s, self._hidden_shape(self.flight[t + 1 - s]), self._dtype())
        mine = self.flight.get(t - s)
        if mine is not None:
            self._compute(t - s, mine)
        done = self.flight.pop(t - self.last, None)
        if done is not None and done.reqs:
            outputs += self._apply(done)
        for out in outputs:
            if out.finished:
                self.owner.pop(out.request_id, None)
        if not self.has_unfinished():
            self.link.drain()
        return outputs

    def _take_waiting(self, engine: LLMEngine) -> None:
        """Before `engine` schedules with nothing waiting and room for a sequence: move it the newest not yet
        started request of the micro-batch with the longest queue, so a micro-batch whose requests ended early
        does not idle while another's queue waits (the same move on every rank: it depends only on their state;
        the request keeps its arrival number, which orders it among the sequences of its new micro-batch)."""
        if engine.scheduler.waiting or len(engine.scheduler.running) >= engine.cfg.max_num_seqs:
            return
        donor = max(self.engines, key=lambda e: len(e.scheduler.waiting))
        seq = donor.scheduler.waiting[-1] if donor.scheduler.waiting else None
        if seq is None or seq.scheduled_once:
            return
        donor.scheduler.waiting.pop()
        engine.scheduler.add(seq)
        engine.requests[seq.request_id] = donor.requests.pop(seq.request_id)
        self.owner[seq.request_id] = engine
        self.moved += 1

    def _schedule(self, engine: LLMEngine) -> _Step | None:
        """The micro-batch's next step on every rank: chunks, tensors, placeholders for its sampled tokens."""
        chunks = engine.scheduler.schedule()
        if not chunks:
            return None
        step = _Step(engine, engine.runner.prepare(chunks, engine.blocks.rows))
        engine.scheduler.after_step(chunks)
        for c in chunks:
            if c.samples:
                step.reqs.append(engine.requests[c.seq.request_id])
                c.seq.output_ids.append(PLACEHOLDER)
                step.slots.append(len(c.seq.output_ids) - 1)
        return step

    def _dtype(self) -> torch.dtype:
        return self.engines[0].runner.pool.keys.dtype

    def _hidden_shape(self, step: _Step) -> tuple[int, int, int]:
        return (1, step.st.tokens.shape[0], self.model.cfg.dim)

    @torch.inference_mode()
    def _compute(self, key: int, step: _Step) -> None:
        """This stage's part of `step`: its blocks over its share of the pool; the last stage samples."""
        st = step.st
        x = st.tokens[None] if self.stage == 0 else self.link.receive(key, self._hidden_shape(step), self._dtype())
        out = self.model(x, st.positions[None], cache=PagedStep(step.engine.runner.pool, st), logits_for=st.logits_for)
        if self.stage < self.last:
            self.link.send(key, out)
        elif step.reqs:
            params = [r.seq.params for r in step.reqs]
            history = [r.seq.output_ids[:slot] for r, slot in zip(step.reqs, step.slots)]
            ids, logprobs = step.engine.sampler.sample(out.float(), params, history)
            step.sampled = _pack(ids, logprobs, params)

    def _apply(self, step: _Step) -> list[RequestOutput]:
        """Every rank: the last stage's sampled tokens put in place of the step's placeholders; the outputs."""
        params = [r.seq.params for r in step.reqs]
        packed = step.sampled if step.sampled is not None else torch.empty(len(params), _width(params),
                                                                          dtype=torch.float64)
        ids, logprobs = _unpack(self.link.from_last(packed.cpu()), params)
        engine = step.engine
        launched = (step.reqs, step.slots, ids, logprobs, ids, None)
        return engine.read_outputs(launched)

    def stats(self) -> EngineStats:
        """The virtual engines' statistics added up."""
        parts = [e.stats() for e in self.engines]
        return EngineStats(*(sum(getattr(p, f) for p in parts) for f in EngineStats.__dataclass_fields__))


def _width(params: list) -> int:
    """Columns of a packed row: the id, then (chosen logprob, top ids, top logprobs) when any row wants logprobs."""
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    return 1 + (1 + 2 * max(wanted) if wanted else 0)


def _pack(ids: torch.Tensor, logprobs: list, params: list) -> torch.Tensor:
    """The sampled ids and logprobs as one float64 tensor (ids below 2**53 are exact)."""
    rows = torch.zeros(len(params), _width(params), dtype=torch.float64)
    rows[:, 0] = ids.cpu().double()
    top_at = 2 + (rows.shape[1] - 2) // 2  # where the top logprobs start, after the top ids
    for i, lp in enumerate(logprobs):
        if lp is not None:
            k = len(lp.top)
            rows[i, 1] = lp.logprob
            rows[i, 2:2 + k] = torch.tensor([t for t, _ in lp.top], dtype=torch.float64)
            rows[i, top_at:top_at + k] = torch.tensor([v for _, v in lp.top], dtype=torch.float64)
    return rows


def _unpack(rows: torch.Tensor, params: list) -> tuple[torch.Tensor, list]:
    """(ids as int64, one TokenLogprobs or None per row) from `_pack`'s tensor."""
    ids = rows[:, 0].long()
    half = (rows.shape[1] - 2) // 2
    logprobs = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            logprobs.append(None)
            continue
        k = p.logprobs
        top = list(zip(rows[i, 2:2 + k].long().tolist(), rows[i, 2 + half:2 + half + k].tolist()))
        logprobs.append(TokenLogprobs(int(ids[i]), float(rows[i, 1]), top))
    return ids, logprobs
