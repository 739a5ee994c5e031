"""Continuous batching with chunked prefill: which sequences run in the next step, and how many tokens each.

Each step has a token budget (`max_num_batched_tokens`), filled in the Sarathi-Serve manner: first one
token for every running sequence that decodes, then the rest of prefills already under way, then new
requests in arrival order, each prefill cut to the budget left (a chunk). So a long prompt never
stalls running decodes: it is spread over several steps that each also advance every decode.

Blocks are taken as tokens are scheduled. When the pool runs out for a running sequence, the newest
running sequence is preempted by recomputation (its blocks freed, it goes back to the head of the
queue and is prefilled again later, prompt and generated tokens together). Waiting requests are
admitted strictly first come, first served: when the oldest cannot get its blocks, nobody behind it
jumps the queue. At most `max_num_seqs` sequences run at once. A request that could not fit even with
the whole pool to itself is refused when it is added (`check_fits`); one that fits later just waits.

With `chunked_prefill=False` the scheduler behaves like the classic prefill-first one (vLLM before
chunked prefill, Orca-style): a step either prefills whole prompts of waiting requests (as many as fit in
max(max_num_batched_tokens, max_model_len) tokens), stalling every running decode for that step, or, when
nothing waits, decodes every running sequence. It is the baseline the serving benchmark compares against.
"""

from __future__ import annotations

from bisect import insort
from collections import deque
from operator import attrgetter

from fourfold.errors import ConfigError
from fourfold.infer.block_manager import BlockManager
from fourfold.infer.sequence import Sequence, SequenceStatus


class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at its `num_computed`; `samples` when they reach its end."""

    __slots__ = ("seq", "num_tokens", "samples")

    def __init__(self, seq: Sequence, num_tokens: int, samples: bool | None = None):
        self.seq, self.num_tokens = seq, num_tokens
        self.samples = seq.num_computed + num_tokens == seq.num_tokens if samples is None else samples
        """Whether the chunk reaches the sequence's last token (None: worked out from the sequence)."""

    def __repr__(self) -> str:
        return f"ScheduledChunk({self.seq.request_id!r}, {self.num_tokens}, samples={self.samples})"


_ARRIVAL = attrgetter("arrival")


class Scheduler:
    """FCFS continuous batching over a BlockManager; `schedule()` once per engine step."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 chunked_prefill: bool = True):
        self.blocks, self.chunked_prefill = blocks, chunked_prefill
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        """Running sequences in arrival order."""
        self.preemptions = 0

    def check_fits(self, seq: Sequence) -> None:
        """ConfigError when `seq` can never run: prompt beyond the context, or more blocks than the pool has."""
        n = len(seq.prompt_ids)
        if n == 0:
            raise ConfigError(f"request {seq.request_id!r} has an empty prompt; give at least one token.")
        if n > self.max_model_len:
            raise ConfigError(f"request {seq.request_id!r} has a {n}-token prompt but the model's context "
                              f"(max_model_len) is {self.max_model_len}; shorten the prompt.")
        longest = min(n + seq.params.max_tokens, self.max_model_len)
        need = self.blocks.blocks_for(longest)
        if need > self.blocks.num_blocks:
            raise ConfigError(f"request {seq.request_id!r} needs up to {need} KV-cache blocks ({longest} tokens) "
                              f"but the pool has {self.blocks.num_blocks}; lower max_tokens or give the KV cache "
                              "more memory (kv_cache_bytes / gpu_memory_utilization).")

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq)
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished (or aborted) and give its blocks back; it may be running or waiting."""
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self.blocks.release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> list[ScheduledChunk]:
        """This step's chunks: decodes first, then running prefills, then new prefills, within the budget."""
        chunks: list[ScheduledChunk] = []
        if not self.chunked_prefill:  # prefill-first: whole prompts while any wait, else every decode
            self._admit(max(self.max_num_batched_tokens, self.max_model_len), chunks, whole=True)
            if not chunks:
                self._run_running(self.max_num_seqs, chunks)
            return chunks
        budget = self._run_running(self.max_num_batched_tokens, chunks)
        self._admit(budget, chunks, whole=False)
        return chunks

    def _run_running(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        """Schedule running sequences (decodes before unfinished prefills, oldest first); the budget left."""
        lefts = [len(s.prompt_ids) + len(s.output_ids) - s.num_computed for s in self.running]  # arrival order
        pairs = list(zip(self.running, lefts))  # a copy: preemption below edits self.running
        if lefts and max(lefts) > 1:  # prefills under way go after every decode
            pairs = [p for p in pairs if p[1] <= 1] + [p for p in pairs if p[1] > 1]
        blocks, block_size, running = self.blocks, self.blocks.block_size, SequenceStatus.RUNNING
        for seq, left in pairs:
            if budget == 0:
                break
            if seq.status is not running:  # preempted earlier in this loop
                continue
            if left == 1 and seq.num_computed < len(seq.block_table) * block_size:  # a decode with room
                chunk = seq.decode_chunk
                if chunk is None:
                    chunk = seq.decode_chunk = ScheduledChunk(seq, 1, True)
                chunks.append(chunk)
                budget -= 1
                continue
            n = left if left < budget else budget
            end = seq.num_computed + n
            if end > len(seq.block_table) * block_size:  # it needs another block
                while not blocks.grow(seq, end):
                    victim = max(self.running, key=_ARRIVAL)
                    self._preempt(victim)
                    for c in [c for c in chunks if c.seq is victim]:
                        chunks.remove(c)
                        budget += c.num_tokens
                    if victim is seq:
                        break
            if seq.status is running:
                chunks.append(ScheduledChunk(seq, n, n == left))
                budget -= n
        return budget

    def _admit(self, budget: int, chunks: list[ScheduledChunk], whole: bool) -> None:
        """Start waiting requests in arrival order within `budget` (whole prompts only when `whole`)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if whole and seq.num_uncomputed > budget:
                break
            hit = self.blocks.match_prefix(seq) if not seq.block_table else seq.num_computed
            n = min(seq.num_uncomputed, budget)
            if not self.blocks.grow(seq, seq.num_computed + n):
                self.blocks.release(seq)  # hand prefix hits back; the head of the queue waits
                break
            if not seq.scheduled_once:  # hit-rate counts first admissions, not retries or recomputations
                seq.cached_prompt_tokens = min(hit, len(seq.prompt_ids))
                self.blocks.count_lookup(len(seq.prompt_ids), seq.cached_prompt_tokens)
            self.waiting.popleft()
            seq.status, seq.scheduled_once = SequenceStatus.RUNNING, True
            insort(self.running, seq, key=_ARRIVAL)  # a recomputation may be older than sequences running
            chunks.append(ScheduledChunk(seq, n))
            budget -= n

    def after_step(self, chunks: list[ScheduledChunk]) -> None:
        """Advance every scheduled sequence past its chunk and register blocks that became full."""
        blocks, block_size = self.blocks, self.blocks.block_size
        caching = blocks.enable_prefix_caching
        for c in chunks:
            seq = c.seq
            seq.num_computed += c.num_tokens
            if caching and seq.num_computed >= (len(seq.block_hashes) + 1) * block_size:  # a block became full
                blocks.register_full_blocks(seq)
