"""The tensors that describe one engine step to the model runner and the attention kernels.

Built once per step on the host and copied to the device in one go; decode steps at a fixed padded
batch size have fixed shapes, so a CUDA graph captured over static copies of these tensors replays
any decode step (fourfold.infer.cuda_graphs). Padding tokens write to the pool's scratch block and
their sequences have length 0 queries.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

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
