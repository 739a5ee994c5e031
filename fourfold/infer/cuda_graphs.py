"""CUDA graphs for decode steps: one graph per padded batch size, replayed over static input buffers.

A decode step (every running sequence adds one token and samples) has shapes that depend only on the
number of sequences, so it is captured once per batch size in `batch_sizes` and replayed; a step of S
sequences runs the smallest captured size B >= S, the extra B - S rows padded:

    graphs = DecodeGraphs(forward, max_batch=256, max_blocks=max_model_len // block_size,
                          block_size=16, scratch_block=pool.scratch_block, device=torch.device("cuda"))
    graphs.capture()                                  # after the model and the KV pool exist
    if graphs.can_run(st):                            # st: the step's tensors (StepTensors) on the device
        logits = graphs.run(st)                       # (S, vocab); valid until the next run
    else:
        logits = runner.decode_forward(st)            # prefill and mixed steps run eagerly

`forward(tokens, positions, slot_mapping, block_tables, seq_lens, query_start, logits_for) -> logits`
takes the StepTensors fields in order (for the engine's runner:
`lambda *t: runner.decode_forward(StepTensors(*t))`) and must do no host work that depends on tensor
values (no .item(), no .tolist()): the paged attention of fourfold.infer.attention_gpu qualifies.
A padded row writes its key and value to slot 0 of the scratch block, reads only that slot, and its
logits are dropped, so real sequences never see it. `compile=True` first wraps `forward` in
torch.compile without its own CUDA graphs (we capture ours); leave it off unless a benchmark says it pays.

On CPU nothing is captured: `run` executes `forward` on the same padded buffers, so the tests check
the padding on CPU and the GPU adds only the capture.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def batch_sizes_up_to(max_batch: int, sizes: Sequence[int] = DEFAULT_BATCH_SIZES) -> list[int]:
    """The sizes to capture: those in `sizes` below max_batch, and max_batch itself, ascending."""
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def bucket_for(batch: int, sizes: Sequence[int]) -> int:
    """The smallest size in ascending `sizes` that holds `batch` rows; ValueError if none does."""
    for size in sizes:
        if size >= batch:
            return size
    raise ValueError(f"a decode batch of {batch} exceeds the largest captured size {sizes[-1]}")


class StaticDecodeInputs:
    """The fixed buffers one graph reads, for a batch of `batch` sequences with `max_blocks` table entries."""

    def __init__(self, batch: int, max_blocks: int, scratch_block: int, block_size: int, device: torch.device):
        self.batch, self.scratch_block = batch, scratch_block
        self.scratch_slot = scratch_block * block_size
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((batch,), self.scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((batch, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(batch, dtype=torch.int32, device=device)
        self.query_start = torch.arange(batch + 1, dtype=torch.int32, device=device)  # one query each
        self.logits_for = torch.arange(batch, dtype=torch.long, device=device)  # every row samples

    def as_args(self) -> tuple[torch.Tensor, ...]:
        return (self.tokens, self.positions, self.slot_mapping, self.block_tables, self.seq_lens,
                self.query_start, self.logits_for)

    def load(self, st) -> int:
        """Copy a decode step's tensors into the buffers, padding rows past its S sequences; returns S."""
        n, width = st.seq_lens.shape[0], st.block_tables.shape[1]
        self.tokens[:n].copy_(st.tokens, non_blocking=True)
        self.positions[:n].copy_(st.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(st.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(st.block_tables, non_blocking=True)
        self.block_tables[:n, width:].fill_(self.scratch_block)
        self.seq_lens[:n].copy_(st.seq_lens, non_blocking=True)
        if n < self.batch:  # rows a previous, larger step left behind
            self.tokens[n:].zero_()
            self.positions[n:].zero_()
            self.slot_mapping[n:].fill_(self.scratch_slot)
            self.block_tables[n:].fill_(self.scratch_block)
            self.seq_lens[n:].fill_(1)
        return n


class DecodeGraphs:
    """Captured decode steps at a set of batch sizes (see the module docstring for the calling pattern)."""

    def __init__(self, forward: Callable[..., torch.Tensor], *, max_batch: int, max_blocks: int, block_size: int,
                 scratch_block: int, device: torch.device, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                 compile: bool = False, warmup_runs: int = 2):
        self.forward = torch.compile(forward, mode="max-autotune-no-cudagraphs", dynamic=False) if compile else forward
        self.max_blocks, self.device = max_blocks, torch.device(device)
        self.sizes = batch_sizes_up_to(max_batch, batch_sizes)
        self.inputs = {b: StaticDecodeInputs(b, max_blocks, scratch_block, block_size, self.device) for b in self.sizes}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.warmup_runs = warmup_runs
        self.use_graphs = self.device.type == "cuda"

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every size, largest first, all graphs sharing one memory pool."""
        if not self.use_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):
                args = self.inputs[b].as_args()
                for _ in range(self.warmup_runs):  # kernel compilation, cuBLAS workspaces, allocator caches
                    self.forward(*args)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[b] = self.forward(*args)
                self.graphs[b] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def can_run(self, st) -> bool:
        """Whether `st` is a decode step a graph can replay: one query and one sample per sequence, small enough."""
        n_seqs, n_tokens = st.seq_lens.shape[0], st.tokens.shape[0]
        return (n_tokens == n_seqs and st.logits_for.shape[0] == n_seqs and n_seqs <= self.sizes[-1]
                and st.block_tables.shape[1] <= self.max_blocks and (not self.use_graphs or bool(self.graphs)))

    @torch.inference_mode()
    def run(self, st) -> torch.Tensor:
        """Logits (S, vocab) of a decode step; on CUDA a view of the graph's output, overwritten by the next run."""
        batch = bucket_for(st.seq_lens.shape[0], self.sizes)
        inputs = self.inputs[batch]
        n = inputs.load(st)
        if not self.use_graphs:
            return self.forward(*inputs.as_args())[:n]
        self.graphs[batch].replay()
        return self.outputs[batch][:n]
