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

Two shortcuts for the engine's runner, where a step's wall time at batch 1 is ~0.5 ms of graph and
every other kernel or copy around it costs a few microseconds:
- `stage(arrays, upload)` puts a decode step's host arrays (fourfold.infer.step_tensors.host_step),
  padded on the host, straight into the graph's static buffers: one copy from pinned memory (tokens,
  positions and slots, block tables and lengths: fourfold.infer.packed_inputs) instead of two uploads and six
  device copies in `load`.
  `run` sees the staged step (its tensors are views of the buffers) and loads nothing.
- every graph also takes the argmax of its logits (the sampler's greedy_argmax), so `greedy_ids()` after
  `run` gives the greedy tokens of the step without a float32 copy of the logits or a kernel outside the graph.

On CPU nothing is captured: `run` executes `forward` on the same padded buffers, so the tests check
the padding on CPU and the GPU adds only the capture.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from fourfold.infer.packed_inputs import PackedInputs
from fourfold.infer.sampler import greedy_argmax
from fourfold.infer.step_tensors import StepTensors

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


def capture_graphs(device: torch.device, keys: Iterable[int], step: Callable[[int, bool], None],
                   warmup_runs: int) -> dict[int, torch.cuda.CUDAGraph]:
    """A CUDA graph of `step(key, True)` for each key (in the order given), all sharing one memory pool, each
    after `warmup_runs` eager calls of `step(key, False)` (kernel compilation, cuBLAS workspaces, allocator
    caches). `step` keeps what it wants of the captured outputs."""
    graphs = {}
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for key in keys:
            for _ in range(warmup_runs):
                step(key, False)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                step(key, True)
            graphs[key] = graph
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    return graphs


class StaticDecodeInputs:
    """The fixed buffers one graph reads, for a batch of `batch` sequences with `max_blocks` table entries."""

    def __init__(self, batch: int, max_blocks: int, scratch_block: int, block_size: int, device: torch.device):
        self.batch, self.max_blocks, self.scratch_block = batch, max_blocks, scratch_block
        self.scratch_slot = scratch_block * block_size
        # one buffer, so a staged step arrives in one copy: int64 tokens | positions | slots, then int32 block
        # tables | sequence lengths
        self.packed = PackedInputs(3 * batch, batch * max_blocks + batch, device)
        self.wide, self.narrow = self.packed.wide, self.packed.narrow
        self.narrow.fill_(scratch_block)
        self.tokens, self.positions, self.slot_mapping = self.wide.view(3, batch).unbind(0)
        self.slot_mapping.fill_(self.scratch_slot)
        self.block_tables = self.narrow[:batch * max_blocks].view(batch, max_blocks)
        self.seq_lens = self.narrow[batch * max_blocks:]
        self.seq_lens.fill_(1)
        self.query_start = torch.arange(batch + 1, dtype=torch.int32, device=device)  # one query each
        self.logits_for = torch.arange(batch, dtype=torch.long, device=device)  # every row samples
        self._views: dict[int, StepTensors] = {}

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

    def host_bytes(self, tokens, positions, slots, tables, lens) -> np.ndarray:
        """The contents of the buffers (`packed.data`) for a decode step of S <= batch sequences (host_step's
        arrays), its rows past S padded as `load` pads them."""
        n, width, b = len(tokens), tables.shape[1], self.batch
        host = self.packed.host_array()
        wide, narrow = self.packed.host_views(host)
        wide[:n], wide[b:b + n], wide[2 * b:2 * b + n] = tokens, positions, slots
        wide[n:b], wide[b + n:2 * b], wide[2 * b + n:] = 0, 0, self.scratch_slot
        narrow.fill(self.scratch_block)
        narrow[:b * self.max_blocks].reshape(b, self.max_blocks)[:n, :width] = tables
        narrow[b * self.max_blocks:] = 1
        narrow[b * self.max_blocks:b * self.max_blocks + n] = lens
        return host

    def step_views(self, n: int) -> StepTensors:
        """The first `n` sequences' rows of the buffers, as the step `stage` hands back (made once per `n`)."""
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = StepTensors(self.tokens[:n], self.positions[:n], self.slot_mapping[:n],
                                                 self.block_tables[:n], self.seq_lens[:n], self.query_start[:n + 1],
                                                 self.logits_for[:n])
        return views

    def holds(self, st) -> bool:
        """Whether `st` is a step staged into these buffers (its tensors are their views)."""
        return (st.tokens.data_ptr() == self.tokens.data_ptr()
                and st.block_tables.data_ptr() == self.block_tables.data_ptr())


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
        self.argmax: dict[int, torch.Tensor] = {}  # each graph's greedy ids, (B,) int64
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.warmup_runs = warmup_runs
        self.use_graphs = self.device.type == "cuda"
        self._last: tuple[int, int] | None = None  # (bucket, sequences) of the last run

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every size, largest first, all graphs sharing one memory pool."""
        if not self.use_graphs:
            return

        def step(b: int, capturing: bool) -> None:
            logits = self.forward(*self.inputs[b].as_args())
            if capturing:
                self.outputs[b], self.argmax[b] = logits, greedy_argmax(logits)
        self.graphs = capture_graphs(self.device, reversed(self.sizes), step, self.warmup_runs)

    def fits(self, n_tokens: int, n_seqs: int, n_sampled: int, table_width: int) -> bool:
        """Whether a step of these sizes is a decode step a graph can replay: one query and one sample per
        sequence, small enough."""
        return (n_tokens == n_seqs == n_sampled and n_seqs <= self.sizes[-1] and table_width <= self.max_blocks
                and (not self.use_graphs or bool(self.graphs)))

    def can_run(self, st) -> bool:
        """Whether a graph can replay the step `st` (StepTensors on the device); see `fits`."""
        return self.fits(st.tokens.shape[0], st.seq_lens.shape[0], st.logits_for.shape[0], st.block_tables.shape[1])

    def stage(self, arrays: Sequence[np.ndarray], upload: Callable[..., torch.Tensor]) -> StepTensors | None:
        """Copy a decode step's host arrays (host_step's seven) into its graph's static buffers in one
        `upload(values, dtype, out=buffer)`; the step as views of those buffers, or None when no graph runs it."""
        tokens, positions, slots, tables, lens, _, logits_for = arrays
        n = len(lens)
        if n == 0 or not self.fits(len(tokens), n, len(logits_for), tables.shape[1]):
            return None
        inputs = self.inputs[bucket_for(n, self.sizes)]
        upload(inputs.host_bytes(tokens, positions, slots, tables, lens), torch.uint8, out=inputs.packed.data)
        return inputs.step_views(n)

    @torch.inference_mode()
    def run(self, st) -> torch.Tensor:
        """Logits (S, vocab) of a decode step; on CUDA a view of the graph's output, overwritten by the next run."""
        batch = bucket_for(st.seq_lens.shape[0], self.sizes)
        inputs = self.inputs[batch]
        n = st.seq_lens.shape[0] if inputs.holds(st) else inputs.load(st)
        self._last = (batch, n)
        if not self.use_graphs:
            self.outputs[batch] = self.forward(*inputs.as_args())
            return self.outputs[batch][:n]
        self.graphs[batch].replay()
        return self.outputs[batch][:n]

    @torch.inference_mode()
    def greedy_ids(self) -> torch.Tensor:
        """(S,) int64: the index of each row's first maximum logit in the last `run` (on CUDA computed inside
        the graph, a view overwritten by the next run)."""
        batch, n = self._last
        if not self.use_graphs:
            return greedy_argmax(self.outputs[batch][:n])
        return self.argmax[batch][:n]
