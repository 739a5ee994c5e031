"""One request inside the engine: its tokens, how many of them are in the KV cache, its blocks and its state.

A sequence's tokens are its prompt followed by what it generated. `num_computed` counts the leading
tokens whose keys and values sit in the paged cache (prefix-cache hits included); the scheduler feeds
the model the tokens after that, a chunk at a time while prefilling, one at a time while decoding.
Preemption by recomputation frees the blocks and sets `num_computed` back to 0: the next schedule
prefills prompt and generated tokens again, and generation continues where it stopped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from fourfold.infer.requests import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is: waiting for its (next) prefill, running, or finished."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request's token state; the scheduler and the block manager update it, the engine reads it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int
    """Order of arrival: first come, first served; the newest running sequence is preempted first."""
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    """Pool block ids holding this sequence's keys and values, in position order."""
    block_hashes: list[int] = field(default_factory=list)
    """Content hashes of the leading full blocks already registered in the prefix cache."""
    num_computed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    cached_prompt_tokens: int = 0
    """Prompt tokens found in the prefix cache at the first schedule."""
    scheduled_once: bool = False
    decode_chunk: object = None
    """The scheduler's reusable one-token chunk for this sequence (built once, not every decode step)."""
    table_row: int = -1
    """This sequence's row in the block manager's BlockRows (fourfold.infer.block_rows); -1 while it holds none."""

    @property
    def token_ids(self) -> list[int]:
        """Prompt then generated tokens."""
        return self.prompt_ids + self.output_ids

    def token_at(self, position: int) -> int:
        """token_ids[position] without building the whole list."""
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]

    def tokens_between(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n:end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before this sequence can sample again."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
