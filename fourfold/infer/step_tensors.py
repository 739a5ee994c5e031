"""The tensors that describe one engine step to the model runner and the attention kernels, and their host build.

Built once per step on the host and copied to the device in one go; decode steps at a fixed padded
batch size have fixed shapes, so a CUDA graph captured over static copies of these tensors replays
any decode step (fourfold.infer.cuda_graphs). Padding tokens write to the pool's scratch block and
their sequences have length 0 queries. `host_step` builds a step's arrays with a few numpy operations
over all sequences at once (positions, slot mapping, offsets); the block tables come from the block
manager's persistent BlockRows (fourfold.infer.block_rows) when every sequence has a row there.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch


@dataclass
class StepTensors:
    """One step: T tokens of S sequences, flattened; the model runs on tokens[None], positions[None]."""

    tokens: torch.Tensor
    """(T,) int64 token ids, sequences concatenated."""
    positions: torch.Tensor
    """(T,) int64 absolute position of each token."""
    slot_mapping: torch.Tensor
    """(T,) int64 flat pool slot (block * block_size + offset) each token's keys and values go to."""
    block_tables: torch.Tensor
    """(S, max_blocks) int32 block ids per sequence, padded with the scratch block."""
    seq_lens: torch.Tensor
    """(S,) int32 tokens cached per sequence after this step's writes."""
    query_start: torch.Tensor
    """(S+1,) int32 offsets of each sequence's tokens in `tokens`."""
    logits_for: torch.Tensor
    """(R,) int64 indices into `tokens` of the last token of each sequence that samples this step."""

    def to(self, device: torch.device) -> "StepTensors":
        """The same step on `device` (non-blocking copies from pinned memory where it applies)."""
        return StepTensors(**{f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)})


def host_step(chunks, block_size: int, scratch_block: int, rows=None) -> tuple[np.ndarray, ...]:
    """The StepTensors fields of `chunks` (ScheduledChunks, before their sequences advance) as numpy arrays.

    Tables come from `rows` (a BlockRows) when every sequence has a row there, else from the
    sequences' block_table lists; max_blocks covers the longest sequence after this step.
    """
    seqs = [c.seq for c in chunks]
    counts = [c.num_tokens for c in chunks]
    firsts = [s.num_computed for s in seqs]
    n_seqs = len(seqs)
    start = np.array(firsts, dtype=np.int64)
    count = np.array(counts, dtype=np.int64)
    seq_lens = start + count
    query_start = np.zeros(n_seqs + 1, dtype=np.int64)
    np.cumsum(count, out=query_start[1:])
    n_tokens = int(query_start[-1])
    width = -(-int(seq_lens.max()) // block_size)
    if n_tokens == n_seqs:  # one token per sequence: decodes (or 1-token prefill chunks)
        owner = np.arange(n_seqs)
        positions = start
        tokens = [s.prompt_ids[p] if p < len(s.prompt_ids) else s.output_ids[p - len(s.prompt_ids)]
                  for s, p in zip(seqs, firsts)]
    else:
        owner = np.repeat(np.arange(n_seqs), count)
        positions = np.arange(n_tokens, dtype=np.int64) - np.repeat(query_start[:-1] - start, count)
        tokens = [t for s, p, n in zip(seqs, firsts, counts) for t in s.tokens_between(p, p + n)]
    table_rows = [s.table_row for s in seqs] if rows is not None else None
    if table_rows is not None and min(table_rows) >= 0:
        tables = rows.gather(table_rows, width)
    else:
        tables = np.full((n_seqs, width), scratch_block, dtype=np.int32)
        for i, s in enumerate(seqs):
            table = s.block_table[:width]
            tables[i, :len(table)] = table
    slots = tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    samples = np.array([c.samples for c in chunks], dtype=bool)
    logits_for = query_start[1:][samples] - 1
    return (np.array(tokens, dtype=np.int64), positions, slots, tables, seq_lens.astype(np.int32),
            query_start.astype(np.int32), logits_for)
