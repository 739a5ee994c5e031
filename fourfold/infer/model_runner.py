"""The model runner: turns a scheduled step into StepTensors, runs the model over the paged cache, returns logits.

    st = runner.prepare(chunks)           # host-side: tokens, positions, slot mapping, block tables, ...
    logits = runner.forward(st)           # (sequences that sample, vocab), float32

The model runs once per step on all scheduled tokens flattened into one row, tokens (1, T) and
positions (1, T) (varlen: no padding between sequences), with `logits_for` picking the last token of
each sequence that samples. `decode_forward(st)` is the pure tensor function of a step (no host
work, no syncs on the GPU kernel path): the CUDA-graph wrapper (fourfold.infer.cuda_graphs) captures
it over static StepTensors padded to a fixed batch size.
"""

from __future__ import annotations

import torch
from torch import nn

from fourfold.infer import attention_gpu
from fourfold.infer.cuda_graphs import DecodeGraphs
from fourfold.infer.kv_pool import KVPool
from fourfold.infer.paged_attention import PagedStep
from fourfold.infer.scheduler import ScheduledChunk
from fourfold.infer.step_tensors import StepTensors


def full_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits as a plain tensor with the whole vocabulary (tensor parallel leaves them vocab-sharded)."""
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return logits


class ModelRunner:
    """Runs `model` (fourfold Llama, any tensor-parallel layout) over a KVPool, one engine step at a time."""

    def __init__(self, model: nn.Module, pool: KVPool, device: torch.device):
        self.model, self.pool, self.device = model, pool, device
        self.graphs: DecodeGraphs | None = None

    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        """On CUDA with the Triton kernel: capture decode steps of up to `max_batch` sequences (padded sizes)."""
        if self.device.type != "cuda" or not attention_gpu.available():
            return
        bs = self.pool.block_size
        self.graphs = DecodeGraphs(lambda *t: self.decode_forward(StepTensors(*t)), max_batch=max_batch,
                                   max_blocks=-(-max_model_len // bs), block_size=bs,
                                   scratch_block=self.pool.scratch_block, device=self.device)
        self.graphs.capture()

    def prepare(self, chunks: list[ScheduledChunk]) -> StepTensors:
        """The step's tensors on the device, from each chunk's sequence state (before it advances)."""
        bs, scratch = self.pool.block_size, self.pool.scratch_block
        tokens, positions, slots, lens, starts, sample_at = [], [], [], [], [0], []
        max_blocks = max(len(c.seq.block_table) for c in chunks)
        tables = []
        for c in chunks:
            seq, a = c.seq, c.seq.num_computed
            b = a + c.num_tokens
            tokens += seq.tokens_between(a, b)
            table = seq.block_table
            positions += range(a, b)
            slots += [table[p // bs] * bs + p % bs for p in range(a, b)]
            tables.append(table + [scratch] * (max_blocks - len(table)))
            lens.append(b)
            starts.append(starts[-1] + c.num_tokens)
            if c.samples:
                sample_at.append(starts[-1] - 1)
        tables = torch.tensor(tables, dtype=torch.int32)
        st = StepTensors(torch.tensor(tokens, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                         torch.tensor(slots, dtype=torch.long), tables,
                         torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                         torch.tensor(sample_at, dtype=torch.long))
        return st.to(self.device) if self.device.type != "cpu" else st

    def decode_forward(self, st: StepTensors) -> torch.Tensor:
        """Logits (len(st.logits_for), vocab) of one step, model dtype; a pure function of the tensors."""
        step = PagedStep(self.pool, st)
        return full_logits(self.model(st.tokens[None], st.positions[None], cache=step, logits_for=st.logits_for))

    @torch.inference_mode()
    def forward(self, st: StepTensors) -> torch.Tensor:
        """Logits of the sampling sequences in float32 (a captured graph replays decode-only steps)."""
        if self.graphs is not None and self.graphs.can_run(st):
            return self.graphs.run(st).float()
        return self.decode_forward(st).float()
