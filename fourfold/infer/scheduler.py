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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fourfold.errors import ConfigError
from fourfold.infer.block_manager import BlockManager
from fourfold.infer.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at its `num_computed`; `samples` when they reach its end."""

    seq: Sequence
    num_tokens: int
    samples: bool = False

    def __post_init__(self):
        self.samples = self.seq.num_computed + self.num_tokens == self.seq.num_tokens


class Scheduler:
    """FCFS continuous batching over a BlockManager; `schedule()` once per engine step."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
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
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        # Decodes (one token each) before prefill chunks, oldest first.
        ordered = sorted(self.running, key=lambda s: (s.num_uncomputed > 1, s.arrival))
        for seq in ordered:
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            n = min(seq.num_uncomputed, budget)
            while not self.blocks.grow(seq, seq.num_computed + n):
                victim = max(self.running, key=lambda s: s.arrival)
                self._preempt(victim)
                for c in [c for c in chunks if c.seq is victim]:
                    chunks.remove(c)
                    budget += c.num_tokens
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                chunks.append(ScheduledChunk(seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
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
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return chunks

    def after_step(self, chunks: list[ScheduledChunk]) -> None:
        """Advance every scheduled sequence past its chunk and register blocks that became full."""
        for c in chunks:
            c.seq.num_computed += c.num_tokens
            self.blocks.register_full_blocks(c.seq)
