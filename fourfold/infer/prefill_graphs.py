"""CUDA graphs for one-sequence prefill steps: a prompt (or a chunk of one) alone in a step, padded to a token count.

At batch 1 the prefill step is bound by the host, not the GPU: a llama-1b prompt of 128 tokens launches about
ten kernels a layer from Python (H200: 1.4 ms of GPU work in an 8 ms step for bf16, 2.1 in 13 ms for int4, whose
int4 matmuls dequantize first; bench/ttft.py). A step of one sequence has shapes that depend only on its token
count, so it is captured once per size in `token_sizes` and replayed; a step of T tokens runs the smallest captured
size P >= T:

    graphs = PrefillGraphs(forward, max_tokens=512, max_blocks=max_model_len // block_size, block_size=16,
                           scratch_block=pool.scratch_block, device=torch.device("cuda"))
    graphs.capture()
    staged = graphs.stage(host_arrays, runner.upload)   # or graphs.run(st) on a step already on the device
    if staged is not None:
        logits = graphs.run(staged)                      # (0 or 1, vocab); valid until the next run

How a step is padded: the graph always sees two sequences. The first is the real one (its T tokens, positions,
slots, block table and length, any cached prefix included). The other P - T tokens form a second sequence of
their own at positions 0 .. P-T-1, whose block table is all scratch block and whose slots cycle through the
scratch block, so its keys and values land only there and its causal attention reads only what it wrote; its
rows are dropped. With T = P the second sequence has no tokens and length 0, and the attention kernels give it
no tiles. The graph computes the logits of the real sequence's last token (or of the token `logits_for` names);
a step that samples nothing (a chunk inside a long prompt) gets none back.

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


MIN_TOKENS = 3
"""The smallest padded size: a step must have more tokens than its two sequences, or the attention kernels
take it for a decode step (one query per sequence)."""


def token_sizes_up_to(max_tokens: int, sizes: Sequence[int] = DEFAULT_TOKEN_SIZES) -> list[int]:
    """The sizes to capture: those in `sizes` below max_tokens, and max_tokens itself, ascending; none below
    MIN_TOKENS (0 turns the graphs off)."""
    if max_tokens < MIN_TOKENS:
        return []
    return sorted({s for s in sizes if MIN_TOKENS <= s < max_tokens} | {max_tokens})


class StaticPrefillInputs:
    """The fixed buffers one graph reads: a step of `size` tokens in two sequences (the real one, then padding)."""

    def __init__(self, size: int, max_blocks: int, scratch_block: int, block_size: int, device: torch.device):
        self.size, self.max_blocks, self.scratch_block, self.block_size = size, max_blocks, scratch_block, block_size
        # int64 tokens | positions | slots | logits_for, then int32 block tables | lengths | query starts: a staged
        # step arrives in one copy (fourfold.infer.packed_inputs)
        self.packed = PackedInputs(3 * size + 1, 2 * max_blocks + 2 + 3, device)
        self.wide, self.narrow = self.packed.wide, self.packed.narrow
        self.tokens, self.positions, self.slot_mapping = self.wide[:3 * size].view(3, size).unbind(0)
        self.logits_for = self.wide[3 * size:]
        self.block_tables = self.narrow[:2 * max_blocks].view(2, max_blocks)
        self.seq_lens = self.narrow[2 * max_blocks:2 * max_blocks + 2]
        self.query_start = self.narrow[2 * max_blocks + 2:]
        self.pad_positions, self.pad_slots = self._padding(size)
        padding = self.host_bytes(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                                  np.zeros((1, 0), np.int32), np.zeros(1, np.int32), np.zeros(0, np.int64))
        self.packed.data.copy_(torch.from_numpy(padding))   # until a step arrives: all padding (what capture runs on)
        self._views: dict[tuple[int, int], StepTensors] = {}

    def _padding(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions and slots of `count` padding tokens: 0, 1, ... and the scratch block's slots in turn."""
        positions = np.arange(count, dtype=np.int64)
        return positions, self.scratch_block * self.block_size + positions % self.block_size

    def as_args(self) -> tuple[torch.Tensor, ...]:
        return (self.tokens, self.positions, self.slot_mapping, self.block_tables, self.seq_lens,
                self.query_start, self.logits_for)

    def host_bytes(self, tokens, positions, slots, tables, lens, logits_for) -> np.ndarray:
        """The contents of the buffers (`packed.data`) for a one-sequence step (host_step's arrays) of at most
        `size` tokens, padded as the module docstring says."""
        n, p, width = len(tokens), self.size, tables.shape[1]
        pad = p - n
        host = self.packed.host_array()
        wide, narrow = self.packed.host_views(host)
        wide[:n], wide[p:p + n], wide[2 * p:2 * p + n] = tokens, positions, slots
        wide[n:p], wide[p + n:2 * p], wide[2 * p + n:3 * p] = 0, self.pad_positions[:pad], self.pad_slots[:pad]
        wide[3 * p] = logits_for[0] if len(logits_for) else max(n - 1, 0)
        narrow.fill(self.scratch_block)
        narrow[:width] = tables[0]
        lens_at = 2 * self.max_blocks
        narrow[lens_at:lens_at + 5] = (lens[0] if n else 0, pad, 0, n, p)   # seq_lens, then query_start
        return host

    def load(self, st) -> None:
        """Copy a one-sequence step's device tensors into the buffers (a step `stage` did not put there)."""
        host = [t.cpu().numpy() for t in (st.tokens, st.positions, st.slot_mapping, st.block_tables, st.seq_lens,
                                          st.logits_for)]
        self.packed.data.copy_(torch.from_numpy(self.host_bytes(*host)), non_blocking=True)

    def holds(self, st) -> bool:
        """Whether `st` is a step staged into these buffers (its tensors are their views)."""
        return st.tokens.data_ptr() == self.tokens.data_ptr() and st.seq_lens.data_ptr() == self.seq_lens.data_ptr()

    def step_views(self, n_tokens: int, n_sampled: int) -> StepTensors:
        """The staged step as the runner sees it: its own tokens, one sequence, the rows it samples (made once per
        shape)."""
        views = self._views.get((n_tokens, n_sampled))
        if views is None:
            views = self._views[n_tokens, n_sampled] = StepTensors(
                self.tokens[:n_tokens], self.positions[:n_tokens], self.slot_mapping[:n_tokens], self.block_tables[:1],
                self.seq_lens[:1], self.query_start[:2], self.logits_for[:n_sampled])
        return views


class PrefillGraphs:
    """Captured one-sequence steps at a set of padded token counts (see the module docstring)."""

    def __init__(self, forward: Callable[..., torch.Tensor], *, max_tokens: int, max_blocks: int, block_size: int,
                 scratch_block: int, device: torch.device, token_sizes: Sequence[int] = DEFAULT_TOKEN_SIZES,
                 warmup_runs: int = 2):
        self.forward, self.max_blocks, self.device = forward, max_blocks, torch.device(device)
        self.sizes = token_sizes_up_to(max_tokens, token_sizes)
        self.inputs = {p: StaticPrefillInputs(p, max_blocks, scratch_block, block_size, self.device)
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
        """Whether a step of these sizes is one a graph can replay: one sequence of at least two tokens (one is a
        decode step: DecodeGraphs) and at most the largest size's, at most one sampled row."""
        return (n_seqs == 1 and 1 < n_tokens <= (self.sizes[-1] if self.sizes else 0) and n_sampled <= 1
                and table_width <= self.max_blocks and (not self.use_graphs or bool(self.graphs)))

    def can_run(self, st) -> bool:
        """Whether a graph can replay the step `st` (StepTensors on the device); see `fits`."""
        return self.fits(st.tokens.shape[0], st.seq_lens.shape[0], st.logits_for.shape[0], st.block_tables.shape[1])

    def holds(self, st) -> bool:
        """Whether `st` was staged into one of the graphs' buffers (by `stage`)."""
        return any(inputs.holds(st) for inputs in self.inputs.values())

    def stage(self, arrays: Sequence[np.ndarray], upload: Callable[..., torch.Tensor]) -> StepTensors | None:
        """Copy a step's host arrays (host_step's seven) into its graph's static buffers in one
        `upload(values, dtype, out=buffer)`; the step as views of those buffers, or None when no graph runs it."""
        tokens, positions, slots, tables, lens, _, logits_for = arrays
        if not self.fits(len(tokens), len(lens), len(logits_for), tables.shape[1]):
            return None
        inputs = self.inputs[bucket_for(len(tokens), self.sizes)]
        upload(inputs.host_bytes(tokens, positions, slots, tables, lens, logits_for), torch.uint8,
               out=inputs.packed.data)
        return inputs.step_views(len(tokens), len(logits_for))

    @torch.inference_mode()
    def run(self, st) -> torch.Tensor:
        """Logits (sampled rows, vocab) of a one-sequence step; on CUDA a view of the graph's output, overwritten by
        the next run."""
        size = bucket_for(st.tokens.shape[0], self.sizes)
        inputs = self.inputs[size]
        if not inputs.holds(st):
            inputs.load(st)
        sampled = st.logits_for.shape[0]
        if not self.use_graphs:
            return self.forward(*inputs.as_args())[:sampled]
        self.graphs[size].replay()
        return self.outputs[size][:sampled]
