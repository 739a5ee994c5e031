"""The inference engine: requests in, RequestOutput deltas out, one scheduled model step at a time.

    engine = LLMEngine.from_model(model, tokenizer, EngineConfig(), device)
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=32, temperature=0))
    while engine.has_unfinished():
        for out in engine.step():          # one RequestOutput per request that advanced
            print(out.request_id, out.text_delta)

Each step: the scheduler picks chunks (fourfold.infer.scheduler), the model runner runs them over the
paged KV cache, the sampler picks a token for every sequence whose prompt is fully computed, and each
request's stop conditions are checked in this order: eos (unless ignore_eos) or a stop token id
('stop'), a stop string in the detokenized text ('stop', text cut before it), max_tokens ('length'),
the context is full ('length': the next token would not fit max_model_len). Finished and aborted
requests give their blocks back at once. With `overlap` (EngineConfig.overlap_steps, CUDA only) a step
launches the model and the sampler, then builds the previous step's outputs while the GPU works: each
`step()` returns the outputs of the step before it (the tokens are the same; stop conditions are checked
before the next step is scheduled, so no sequence runs past its end). The async API
(fourfold.infer.async_engine) and the offline `LLM` (fourfold.infer.llm) drive this class. A CUDA engine, once
built, freezes the Python heap (EngineConfig.freeze_gc, fourfold.infer.gc_freeze) so that garbage-collector runs
do not traverse the setup's objects in the middle of requests.

The host work per step is kept small (bench/engine_host.py measures it): the step's index arrays are
built with numpy over the block manager's persistent table rows (fourfold.infer.step_tensors), stop
rules are precomputed per request (fourfold.infer.request_state), and requests that set
`SamplingParams.detokenize=False` skip per-token detokenization.
"""

from __future__ import annotations

import gc
import itertools
import time

import torch
import torch.distributed as dist
from torch import nn

from fourfold.errors import ConfigError
from fourfold.infer import gc_freeze
from fourfold.infer.block_manager import BlockManager
from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.kv_pool import KVPool, block_bytes, blocks_for_budget, cuda_budget
from fourfold.infer.model_runner import ModelRunner
from fourfold.infer.pipeline_runner import PipelineRunner
from fourfold.infer.request_state import RequestState, apply_tokens, build_outputs
from fourfold.infer.requests import EngineStats, RequestOutput, SamplingParams
from fourfold.infer.sampler import Sampler, plain_greedy
from fourfold.infer.scheduler import Scheduler
from fourfold.infer.sequence import Sequence
from fourfold.quant import one_copy


PLACEHOLDER = -1
"""The output token of a launched step until its sampled id is read back (fourfold.infer.block_manager
does not hash a block that holds one)."""


def pool_for(model: nn.Module, cfg: EngineConfig, device: torch.device, kv_heads: int, dtype: torch.dtype,
             group: dist.ProcessGroup | None = None) -> KVPool:
    """A KV pool for the blocks `model` holds, sized by `cfg`; ranks of `group` agree on the smallest size."""
    mcfg = model.cfg
    first_layer = min(int(name) for name in model.layers)
    n_layers = len(model.layers)
    per_block = block_bytes(n_layers, cfg.block_size, kv_heads, mcfg.head_dim, dtype)
    num = cfg.num_kv_blocks
    if num == 0 and device.type == "cuda":
        # What a dropped engine held (its runner and CUDA graphs form reference cycles, so `del` alone
        # frees nothing) and what the caching allocator keeps must count as free: collect, then give
        # the cache back, or a second engine in one process gets a pool of the leftovers.
        gc.collect()
        torch.cuda.empty_cache()
        num = blocks_for_budget(cuda_budget(device, cfg.gpu_memory_utilization), per_block)
    elif num == 0:
        num = blocks_for_budget(cfg.kv_cache_bytes, per_block)
    if group is not None:  # ranks that step in lockstep must schedule over the same pool size
        count = torch.tensor([num], device=device if dist.get_backend(group) == "nccl" else "cpu")
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=group)
        num = int(count.item())
    if num < 1:
        raise ConfigError(f"No room for a KV-cache block ({per_block} bytes): raise gpu_memory_utilization or "
                          "kv_cache_bytes, or set num_kv_blocks.")
    return KVPool(n_layers, num, cfg.block_size, kv_heads, mcfg.head_dim, dtype, device, first_layer)


class LLMEngine:
    """Continuous-batching engine over one model replica (its tensor-parallel ranks run it in lockstep)."""

    def __init__(self, runner: ModelRunner, tokenizer, cfg: EngineConfig, max_model_len: int,
                 eos_id: int | None = None, model_name: str = "fourfold", chat_template=None,
                 sampling_seed: int | None = None):
        self.runner, self.tokenizer, self.cfg = runner, tokenizer, cfg
        self.max_model_len, self.model_name, self.chat_template = max_model_len, model_name, chat_template
        self.eos_id = eos_id if eos_id is not None else getattr(tokenizer, "eos_id", None)
        pool = runner.pool
        self.blocks = BlockManager(pool.num_blocks, pool.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens, max_model_len,
                                   cfg.enable_chunked_prefill)
        # Tensor-parallel ranks sample in lockstep: the same seed gives every rank the same draws.
        generator = None if sampling_seed is None else torch.Generator(runner.device).manual_seed(sampling_seed)
        self.sampler = Sampler(generator)
        self.requests: dict[str, RequestState] = {}
        self._arrivals = itertools.count()
        self._aborted: list[RequestOutput] = []
        self._decode_cache: dict = {}  # text of short id windows, shared by the requests' detokenizers
        self.prompt_tokens = self.generation_tokens = 0
        self.overlap = cfg.overlap_steps and runner.device.type == "cuda"
        self.look_aheads = 0  # steps launched before the previous step's tokens were read
        self._pending: tuple | None = None  # what _launch returned for a launched step not read yet

    @classmethod
    def from_model(cls, model: nn.Module, tokenizer, cfg: EngineConfig | None = None,
                   device: torch.device | None = None, kv_heads: int | None = None,
                   group: dist.ProcessGroup | None = None, pipeline_ranks: list[int] | None = None,
                   **kwargs) -> "LLMEngine":
        """An engine for `model` (already on `device`, eval mode) with a KV pool sized by `cfg`.

        Tensor- or pipeline-parallel ranks pass `group` (all of them; the pool size is agreed over it) and,
        for pipeline stages, `pipeline_ranks` (global ranks in stage order); give them one `sampling_seed`.
        """
        cfg = cfg or EngineConfig()
        device = device or next(model.parameters()).device
        gc_freeze.thaw()  # an engine built before may have been dropped: its objects must be collectable again
        dtype = next(model.parameters()).dtype
        kv_heads = kv_heads or model.cfg.n_kv_heads
        max_len = min(cfg.max_model_len or model.cfg.max_seq_len, model.cfg.max_seq_len)
        if group is None and pipeline_ranks is None:   # int4 linears keep one run-time copy: the rest goes to the pool
            one_copy.keep_one_copy(model, device)
        pool = pool_for(model, cfg, device, kv_heads, dtype, group)
        if pipeline_ranks is not None:
            runner = PipelineRunner(model, pool, device, pipeline_ranks)
        else:
            runner = ModelRunner(model, pool, device, fuse=None if cfg.fused_decoder else False)
        if cfg.cuda_graphs:
            runner.capture_decode_graphs(cfg.max_num_seqs, max_len)
            runner.capture_prefill_graphs(min(cfg.prefill_graph_tokens, cfg.max_num_batched_tokens), max_len,
                                          min(cfg.prefill_graph_seqs or cfg.max_num_seqs, cfg.max_num_seqs))
        engine = cls(runner, tokenizer, cfg, max_len, **kwargs)
        if cfg.freeze_gc and device.type == "cuda":
            gc_freeze.freeze()
        return engine

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        """Queue a request (text or token ids); ConfigError for bad parameters or one that can never fit."""
        self._check_open()
        params = params or SamplingParams()
        params.check()
        if request_id in self.requests:
            raise ConfigError(f"request id {request_id!r} is already in use; give each request its own id.")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        seq = Sequence(request_id, ids, params, next(self._arrivals))
        self.scheduler.add(seq)
        self.requests[request_id] = RequestState(seq, self.tokenizer, self.eos_id, self.max_model_len, time.monotonic(),
                                                 self._decode_cache)
        self.prompt_tokens += len(ids)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; its last output (finish_reason 'abort') comes with the next step."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self.scheduler.finish(req.seq, "abort")
        while req.seq.output_ids and req.seq.output_ids[-1] == PLACEHOLDER:  # tokens of steps not read yet
            req.seq.output_ids.pop()
        self._aborted.append(RequestOutput(request_id, [], req.final_text(), True, "abort",
                                           len(req.seq.prompt_ids), len(req.seq.output_ids),
                                           cached_prompt_tokens=req.seq.cached_prompt_tokens))

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._aborted) or self._pending is not None

    def close(self) -> None:
        """Give the engine's memory back now: its requests end, it lets go of its runner (the model's fused weights,
        the KV pool, the CUDA graphs), a CUDA engine's heap freeze is undone (frozen objects are never collected, and
        the runner's graphs hold it in reference cycles: `del engine` alone frees nothing until the next engine is
        built) and the collector runs. Later calls do nothing; the engine takes no requests afterwards."""
        if self.runner is None:
            return
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self._aborted, self._pending, self.runner = [], None, None
        gc_freeze.thaw()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _check_open(self) -> None:
        if self.runner is None:
            raise ConfigError("this engine was closed (LLMEngine.close); build a new one to run requests.")

    # -- stepping ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled model step; the outputs of every request that produced a token or finished
        (with `overlap`: those of the previous step, read back while this one runs)."""
        self._check_open()
        outputs, self._aborted = self._aborted, []
        if not self.overlap:
            launched = self._launch()
            if launched is not None:
                outputs += self.read_outputs(launched)
            return outputs
        previous, self._pending = self._pending, None
        if previous is not None and self.cfg.look_ahead and self._can_look_ahead(previous):
            self.look_aheads += 1
            self._pending = self._launch(previous)  # the previous tokens go in on the device
            applied = self._read(previous)
        else:
            applied = self._read(previous) if previous is not None else ([], 0.0)
            self._pending = self._launch()
        return outputs + build_outputs(*applied)

    def _launch(self, previous: tuple | None = None) -> tuple | None:
        """Schedule a step, run the model and the sampler (asynchronously on CUDA); what `_read` needs.

        Each sampling sequence gets a placeholder token that `_read` replaces; with `previous` (its tokens
        not read yet) the placeholders of that step are filled on the device from its sampled ids.
        """
        preemptions = self.scheduler.preemptions
        chunks = self.scheduler.schedule()
        if not chunks:
            return None
        st = self.runner.prepare(chunks, self.blocks.rows)
        if previous is not None:
            self._fill_placeholders(st, chunks, previous, self.scheduler.preemptions == preemptions)
        sampling = [c.seq for c in chunks if c.samples]
        params = [s.params for s in sampling]
        token_ids = self.runner.forward_greedy(st) if sampling and plain_greedy(params) else None
        logits = self.runner.forward(st) if token_ids is None else None
        self.scheduler.after_step(chunks)
        if not sampling:
            return None
        outs = [s.output_ids for s in sampling]
        if token_ids is None:
            token_ids, logprobs = self.sampler.sample(logits, params, outs)
        else:
            logprobs = [None] * len(sampling)
        reqs = [self.requests[s.request_id] for s in sampling]
        slots = [len(o) for o in outs]
        for o in outs:
            o.append(PLACEHOLDER)
        host, ready = self.runner.download(token_ids)  # CUDA: pinned, so a step queued behind need not finish
        return reqs, slots, token_ids, logprobs, host, ready

    def _fill_placeholders(self, st, chunks, previous: tuple, none_preempted: bool) -> None:
        """Put `previous`'s sampled ids (still on the device) where this step's tokens hold its placeholders."""
        reqs, slots, token_ids = previous[:3]
        if (none_preempted and st.tokens.shape[0] == len(chunks) == len(reqs)
                and all(c.seq is r.seq for c, r in zip(chunks, reqs))):
            # The same sequences decode again, in the same order: each one's only token is its placeholder.
            st.tokens.copy_(token_ids)
            return
        source = {id(req.seq): (i, len(req.seq.prompt_ids) + slot) for i, (req, slot) in enumerate(zip(reqs, slots))}
        dst, src, offset = [], [], 0
        for c in chunks:
            a = c.seq.num_computed
            i, position = source.get(id(c.seq), (None, -1))
            if i is not None and a <= position < a + c.num_tokens:
                dst.append(offset + position - a)
                src.append(i)
            offset += c.num_tokens
        if dst:
            index = self.runner.upload(dst + src, torch.long)  # pinned: a pageable copy would wait for the GPU
            st.tokens.index_copy_(0, index[:len(dst)], token_ids.index_select(0, index[len(dst):]))

    def _can_look_ahead(self, previous: tuple) -> bool:
        """Whether the next step can be scheduled before `previous`'s tokens are read: nothing waits to be
        admitted, no pending token ends its sequence by length, and no running sequence uses penalties."""
        if self.scheduler.waiting or len(self.scheduler.running) > self.cfg.look_ahead_max_seqs:
            return False
        if any(slot >= req.last_slot for req, slot in zip(previous[0], previous[1])):
            return False
        return not any(s.params.repetition_penalty != 1.0 or s.params.frequency_penalty != 0.0
                       or s.params.presence_penalty != 0.0 for s in self.scheduler.running)

    def _read(self, launched: tuple) -> tuple[list[tuple], float]:
        """Wait for a launched step's tokens, put them in place of its placeholders and apply the stop
        conditions; the `build_outputs` arguments."""
        reqs, slots, _, logprobs, host, ready = launched
        if ready is not None:
            ready.synchronize()
        applied = apply_tokens(reqs, slots, host.tolist(), logprobs, self._finish)
        self.generation_tokens += len(applied)
        return applied, time.monotonic()

    def read_outputs(self, launched: tuple) -> list[RequestOutput]:
        """`_read` then `build_outputs`: a launched step's RequestOutputs (other schedulers of steps use it;
        launched = (request states, output slots, ids, logprobs, host ids, event or None))."""
        return build_outputs(*self._read(launched))

    def _finish(self, req: RequestState, reason: str, slot: int) -> None:
        """End a request whose token at output `slot` met a stop condition."""
        seq = req.seq
        del seq.output_ids[slot + 1:]  # a look-ahead step's placeholder
        self.scheduler.finish(seq, reason)
        del self.requests[seq.request_id]

    def stats(self) -> EngineStats:
        """Running/waiting sequences, KV blocks, prefix-cache hit counts, preemptions, token counts."""
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), self.blocks.num_blocks, self.blocks.num_used,
                           self.blocks.queries, self.blocks.hits, s.preemptions, self.prompt_tokens,
                           self.generation_tokens)
