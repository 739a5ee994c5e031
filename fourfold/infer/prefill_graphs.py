"""CUDA graphs for steps with prefill tokens: a prompt (or a chunk of one), alone or beside other sequences' decode
tokens and chunks, padded to a token count.

Such a step run eagerly is bound by the host, not the GPU: a llama-1b prompt of 128 tokens launches about ten
kernels a layer from Python (H200: 1.4 ms of GPU work in an 8 ms step for bf16, 2.1 in 13 ms for int4, whose int4
matmuls dequantize first; bench/ttft.py), and so is the mixed step that continuous batching makes whenever a
request arrives while others decode (63 decode tokens and a 32-token chunk: 8.8 ms bf16, 20.0 ms int4-g128;
bench/int4_steps_gpu.py). Every shape of such a step depends only on its token count once its sequences are
padded to a fixed number, so it is captured once per size in `token_sizes` and replayed; a step of T tokens runs
the smallest captured size P >= T:

    graphs = PrefillGraphs(forward, max_tokens=2048, max_blocks=max_model_len // block_size, block_size=16,
                           scratch_block=pool.scratch_block, device=torch.device("cuda"), max_seqs=256)
    graphs.capture()
    staged = graphs.stage(host_arrays, runner.upload)   # or graphs.run(st) on a step already on the device
    if staged is not None:
        logits = graphs.run(staged)                      # (sampled rows, vocab); valid until the next run

How a step is padded: a graph of P tokens sees `sequence_slots(P, max_seqs)` sequences, fewer than P (so the
attention kernels take it for a step with prefill tokens, not a decode step), at most max_seqs + 1. The first S
are the step's own (their tokens, positions, slots, block tables and lengths, any cached prefix included). The
next one takes the P - T padding tokens, at positions 0 .. P-T-1, with a block table of the scratch block only and
slots that cycle through the scratch block, so its keys and values land only there and its causal attention reads
only what it wrote; its rows are dropped. The rest are empty (no tokens, length 0), and the attention kernels give
them no tiles. With T = P the padding sequence is empty too (a step of P tokens may then fill every slot). The graph
computes the logits of the rows `logits_for` names, padded to a fixed count with rows nobody reads; a step gets back
its own sampled rows (none for a chunk inside a long prompt). A step goes up in one copy that stops after the
padding sequence's table row: the empty sequences' rows are never read.

`forward(tokens, positions, slot_mapping, block_tables, seq_lens, query_start, logits_for)` is the same pure
step function as fourfold.infer.cuda_graphs.DecodeGraphs takes. On CPU nothing is captured and `run` executes
`forward` on the same padded buffers, so the tests check the padding on CPU and the GPU adds only the capture.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from fourfold.infer.cuda_graphs import bucket_for, capture_graphs
from fourfold.infer.packed_inputs import PackedInputs
from fourfold.infer.step_tensors import StepTensors

DEFAULT_TOKEN_SIZES = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
"""Padded token counts to capture (those up to `max_tokens`): steps of 1.5x apart at most, so a step computes at
most half again its own tokens."""


MAX_VIEWS = 1024
"""Step shapes whose tensor views a graph's buffers keep (StaticPrefillInputs.step_views); more start afresh."""


MIN_TOKENS = 3
"""The smallest padded size: a step must have more tokens than its two sequences, or the attention kernels
take it for a decode step (one query per sequence)."""


def token_sizes_up_to(max_tokens: int, sizes: Sequence[int] = DEFAULT_TOKEN_SIZES) -> list[int]:
    """The sizes to capture: those in `sizes` below max_tokens, and max_tokens itself, ascending; none below
    MIN_TOKENS (0 turns the graphs off)."""
    if max_tokens < MIN_TOKENS:
        return []
    return sorted({s for s in sizes if MIN_TOKENS <= s < max_tokens} | {max_tokens})


def sequence_slots(size: int, max_seqs: int) -> int:
    """Sequences a graph of `size` tokens holds: the step's own (at most `max_seqs`), one of padding tokens and
    empty ones; fewer than `size`, so the attention kernels see a step with prefill tokens, never a decode step."""
    return max(2, min(size - 1, max_seqs + 1))


class StaticPrefillInputs:
    """The fixed buffers one graph reads: a step of `size` tokens in `sequence_slots` sequences (the step's own, then
    one of padding tokens, then empty ones) and `sampled` rows of logits."""

    def __init__(self, size: int, max_blocks: int, scratch_block: int, block_size: int, device: torch.device,
                 max_seqs: int = 1):
        self.size, self.max_blocks, self.scratch_block, self.block_size = size, max_blocks, scratch_block, block_size
        self.seqs, self.max_seqs = sequence_slots(size, max_seqs), max_seqs
        self.sampled = min(self.seqs, max_seqs)
        # int64 tokens | positions | slots | logits_for, then int32 lengths | query starts | block tables: a staged
        # step arrives in one copy (fourfold.infer.packed_inputs), of the table rows it uses only
        seqs = self.seqs
        self.packed = PackedInputs(3 * size + self.sampled, 2 * seqs + 1 + seqs * max_blocks, device)
        self.wide, self.narrow = self.packed.wide, self.packed.narrow
        self.tokens, self.positions, self.slot_mapping = self.wide[:3 * size].view(3, size).unbind(0)
        self.logits_for = self.wide[3 * size:]
        self.seq_lens = self.narrow[:seqs]
        self.query_start = self.narrow[seqs:2 * seqs + 1]
        self.block_tables = self.narrow[2 * seqs + 1:].view(seqs, max_blocks)
        self.pad_positions, self.pad_slots = self._padding(size)
        padding = self.host_bytes(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                                  np.zeros((0, 0), np.int32), np.zeros(0, np.int32), np.zeros(1, np.int32),
                                  np.zeros(0, np.int64))
        host = self.packed.host_array()
        host[:len(padding)] = padding
        _, narrow = self.packed.host_views(host)
        narrow[2 * seqs + 1:] = scratch_block   # every table row, those a step leaves alone included
        self.packed.data.copy_(torch.from_numpy(host))   # until a step arrives: all padding (what capture runs on)
        self._views: dict[tuple[int, int, int], StepTensors] = {}

    def _padding(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions and slots of `count` padding tokens: 0, 1, ... and the scratch block's slots in turn."""
        positions = np.arange(count, dtype=np.int64)
        return positions, self.scratch_block * self.block_size + positions % self.block_size

    def as_args(self) -> tuple[torch.Tensor, ...]:
        return (self.tokens, self.positions, self.slot_mapping, self.block_tables, self.seq_lens,
                self.query_start, self.logits_for)

    def fits(self, n_tokens: int, n_seqs: int, n_sampled: int) -> bool:
        """Whether a step of these sizes pads into these buffers: at most max_seqs sequences, which leave a slot for
        the padding tokens' (none needed when the step fills the size)."""
        return (n_tokens <= self.size and n_sampled <= self.sampled and n_seqs <= self.max_seqs
                and (n_seqs < self.seqs or (n_seqs == self.seqs and n_tokens == self.size)))

    def host_bytes(self, tokens, positions, slots, tables, lens, starts, logits_for) -> np.ndarray:
        """The leading part of the buffers' contents (`packed.data`) for a step (host_step's seven arrays) that
        `fits`, padded as the module docstring says; the table rows past the padding sequence's are left out (the
        empty sequences read none)."""
        n, p, s, width = len(tokens), self.size, len(lens), tables.shape[1]
        pad, seqs, used_rows = p - n, self.seqs, min(s + 1, self.seqs)
        host = self.packed.host_array()
        wide, narrow = self.packed.host_views(host)
        wide[:n], wide[p:p + n], wide[2 * p:2 * p + n] = tokens, positions, slots
        wide[n:p], wide[p + n:2 * p], wide[2 * p + n:3 * p] = 0, self.pad_positions[:pad], self.pad_slots[:pad]
        r = len(logits_for)
        wide[3 * p:3 * p + r] = logits_for
        wide[3 * p + r:] = max(n - 1, 0)   # rows nobody reads
        lengths, query_start = narrow[:seqs], narrow[seqs:2 * seqs + 1]
        lengths.fill(0)
        lengths[:s] = lens
        query_start.fill(p)
        query_start[:s + 1] = starts if s else 0
        if s < seqs:   # the padding sequence, right after the step's own: tokens n..p-1
            lengths[s] = pad
        rows = narrow[2 * seqs + 1:2 * seqs + 1 + used_rows * self.max_blocks].reshape(used_rows, self.max_blocks)
        rows.fill(self.scratch_block)
        rows[:s, :width] = tables
        return host[:self.packed.wide_bytes + 4 * (2 * seqs + 1 + used_rows * self.max_blocks)]

    def load(self, st) -> None:
        """Copy a step's device tensors into the buffers (a step `stage` did not put there)."""
        host = [t.cpu().numpy() for t in (st.tokens, st.positions, st.slot_mapping, st.block_tables, st.seq_lens,
                                          st.query_start, st.logits_for)]
        data = torch.from_numpy(self.host_bytes(*host))
        self.packed.data[:len(data)].copy_(data, non_blocking=True)

    def holds(self, st) -> bool:
        """Whether `st` is a step staged into these buffers (its tensors are their views)."""
        return st.tokens.data_ptr() == self.tokens.data_ptr() and st.seq_lens.data_ptr() == self.seq_lens.data_ptr()

    def step_views(self, n_tokens: int, n_seqs: int, n_sampled: int) -> StepTensors:
        """The staged step as the runner sees it: its own tokens, sequences and sampled rows (made once per shape)."""
        key = (n_tokens, n_seqs, n_sampled)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= MAX_VIEWS:
                self._views.clear()
            views = self._views[key] = StepTensors(
                self.tokens[:n_tokens], self.positions[:n_tokens], self.slot_mapping[:n_tokens],
                self.block_tables[:n_seqs], self.seq_lens[:n_seqs], self.query_start[:n_seqs + 1],
                self.logits_for[:n_sampled])
        return views


class PrefillGraphs:
    """Captured steps with prefill tokens at a set of padded token counts (see the module docstring)."""

    def __init__(self, forward: Callable[..., torch.Tensor], *, max_tokens: int, max_blocks: int, block_size: int,
                 scratch_block: int, device: torch.device, max_seqs: int = 1,
                 token_sizes: Sequence[int] = DEFAULT_TOKEN_SIZES, warmup_runs: int = 2):
        self.forward, self.max_blocks, self.device = forward, max_blocks, torch.device(device)
        self.sizes = token_sizes_up_to(max_tokens, token_sizes)
        self.inputs = {p: StaticPrefillInputs(p, max_blocks, scratch_block, block_size, self.device, max_seqs)
                       for p in self.sizes}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.warmup_runs = warmup_runs
        self.use_graphs = self.device.type == "cuda"

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every size, largest first, all graphs sharing one memory pool."""
        if not self.use_graphs or not self.sizes:
            return

        def step(p: int, capturing: bool) -> None:
            logits = self.forward(*self.inputs[p].as_args())
            if capturing:
                self.outputs[p] = logits
        self.graphs = capture_graphs(self.device, reversed(self.sizes), step, self.warmup_runs)

    def fits(self, n_tokens: int, n_seqs: int, n_sampled: int, table_width: int) -> bool:
        """Whether a step of these sizes is one a graph can replay: more tokens than sequences (a step of one token a
        sequence is a decode step: DecodeGraphs), at most the largest size's tokens, and sequences and sampled rows
        that its size's buffers hold."""
        if not (1 < n_tokens <= (self.sizes[-1] if self.sizes else 0) and n_seqs < n_tokens
                and table_width <= self.max_blocks and (not self.use_graphs or bool(self.graphs))):
            return False
        return self.inputs[bucket_for(n_tokens, self.sizes)].fits(n_tokens, n_seqs, n_sampled)

    def can_run(self, st) -> bool:
        """Whether a graph can replay the step `st` (StepTensors on the device); see `fits`."""
        return self.fits(st.tokens.shape[0], st.seq_lens.shape[0], st.logits_for.shape[0], st.block_tables.shape[1])

    def holds(self, st) -> bool:
        """Whether `st` was staged into one of the graphs' buffers (by `stage`)."""
        return any(inputs.holds(st) for inputs in self.inputs.values())

    def stage(self, arrays: Sequence[np.ndarray], upload: Callable[..., torch.Tensor]) -> StepTensors | None:
        """Copy a step's host arrays (host_step's seven) into its graph's static buffers in one
        `upload(values, dtype, out=buffer)`; the step as views of those buffers, or None when no graph runs it."""
        tokens, _, _, tables, lens, _, logits_for = arrays
        if not self.fits(len(tokens), len(lens), len(logits_for), tables.shape[1]):
            return None
        inputs = self.inputs[bucket_for(len(tokens), self.sizes)]
        upload(inputs.host_bytes(*arrays), torch.uint8, out=inputs.packed.data)
        return inputs.step_views(len(tokens), len(lens), len(logits_for))

    @torch.inference_mode()
    def run(self, st) -> torch.Tensor:
        """Logits (sampled rows, vocab) of the step; on CUDA a view of the graph's output, overwritten by the next
        run."""
        size = bucket_for(st.tokens.shape[0], self.sizes)
        inputs = self.inputs[size]
        if not inputs.holds(st):
            inputs.load(st)
        sampled = st.logits_for.shape[0]
        if not self.use_graphs:
            return self.forward(*inputs.as_args())[:sampled]
        self.graphs[size].replay()
        return self.outputs[size][:sampled]
