"""The model runner: turns a scheduled step into StepTensors, runs the model over the paged cache, returns logits.

    st = runner.prepare(chunks)           # host-side: tokens, positions, slot mapping, block tables, ...
    logits = runner.forward(st)           # (sequences that sample, vocab), float32
    ids = runner.forward_greedy(st)       # decode steps a CUDA graph replays: greedy ids, argmax in the graph

On CUDA, decode steps and steps with prefill tokens replay CUDA graphs (fourfold.infer.cuda_graphs,
fourfold.infer.prefill_graphs) where their sizes allow.

The model runs once per step on all scheduled tokens flattened into one row, tokens (1, T) and
positions (1, T) (varlen: no padding between sequences), with `logits_for` picking the last token of
each sequence that samples. `decode_forward(st)` is the pure tensor function of a step (no host
work, no syncs on the GPU kernel path): the CUDA-graph wrapper (fourfold.infer.cuda_graphs) captures
it over static StepTensors padded to a fixed batch size. With `fuse=True` (on CUDA by default) a whole
fourfold Llama runs through fourfold.infer.fused_decoder (fused q|k|v and gate|up weights, fused
elementwise kernels); tensor-parallel and pipeline models keep the model's own forward. The step's index
arrays are built with numpy (fourfold.infer.step_tensors.host_step); on CUDA they go up in non-blocking
copies from pinned host buffers: two for an eager step, one for a step a graph replays, straight into the
graph's static buffers (DecodeGraphs.stage, PrefillGraphs.stage).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fourfold.infer import attention_gpu, decode_attention_gpu
from fourfold.infer.block_rows import BlockRows
from fourfold.infer.cpu_decoder import CpuDecoder
from fourfold.infer.cuda_graphs import DecodeGraphs
from fourfold.infer.fused_decoder import FusedDecoder
from fourfold.infer.fused_ops import rotary_kv_write
from fourfold.infer.kv_pool import KVPool
from fourfold.infer.paged_attention import PagedStep, TorchAttentionPlan
from fourfold.infer.prefill_graphs import PrefillGraphs
from fourfold.infer.scheduler import ScheduledChunk
from fourfold.infer.step_tensors import StepTensors, host_step

UPLOAD_RING = 8
"""Pinned host buffers per dtype that step uploads rotate through."""
DOWNLOAD_RING = 4
"""Pinned host buffers that sampled ids are read back through (a step's ids are read before 4 more launch)."""


def aligned_views(parts: list[np.ndarray], dtype, upload) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`parts` (numpy arrays of one dtype) uploaded together by `upload(values)` as one tensor, each part starting at
    a multiple of 16 bytes; the parts' views of it (same shapes) and the tensor.

    An eager step's kernels then see every input pointer 16-byte aligned, as the captured graphs' inputs are, so
    Triton compiles no variant for misaligned pointers that a step of some odd size would otherwise meet first in
    the middle of serving."""
    per = 16 // np.dtype(dtype).itemsize
    sizes = [p.size for p in parts]
    padded = [-(-n // per) * per for n in sizes]
    flat = np.zeros(sum(padded), dtype=dtype)
    offsets = np.cumsum([0] + padded[:-1])
    for p, at, n in zip(parts, offsets, sizes):
        flat[at:at + n] = p.ravel()
    data = upload(flat)
    return [data[at:at + n].view(p.shape) for p, at, n in zip(parts, offsets, sizes)], data


def full_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits as a plain tensor with the whole vocabulary (tensor parallel leaves them vocab-sharded)."""
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return logits


class ModelRunner:
    """Runs `model` (fourfold Llama, any tensor-parallel layout) over a KVPool, one engine step at a time."""

    def __init__(self, model: nn.Module, pool: KVPool, device: torch.device, fuse: bool | None = None):
        self.model, self.pool, self.device = model, pool, device
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.cpu_decoder = CpuDecoder.from_model(model) if fuse is None and device.type == "cpu" else None
        self.gpu_kernels = attention_gpu.runs_on(device, pool.keys.dtype)
        if fuse is None:
            fuse = self.gpu_kernels
        self.fused = FusedDecoder.from_model(model) if fuse else None
        self._pinned: dict[torch.dtype, list] = {}  # per dtype a ring of (pinned buffer, event after its copy)
        self._upload_turn: dict[torch.dtype, int] = {}
        self._downloads: list = [(None, None)] * DOWNLOAD_RING  # (pinned buffer, event after its copy)
        self._download_turn = 0
        # an int index makes torch.cuda.current_stream a lookup (a device without one is resolved on every call)
        self._device_index = (device.index if device.index is not None else torch.cuda.current_device()
                              if device.type == "cuda" else None)

    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        """On CUDA with the Triton kernel: capture decode steps of up to `max_batch` sequences (padded sizes)."""
        if not self.gpu_kernels:
            return
        self.graphs = DecodeGraphs(max_batch=max_batch, **self._graph_settings(max_model_len))
        self.graphs.capture()

    def capture_prefill_graphs(self, max_tokens: int, max_model_len: int, max_seqs: int = 1) -> None:
        """On CUDA with the fused decoder: capture steps with prefill tokens, of up to `max_tokens` tokens (padded
        sizes) and `max_seqs` sequences."""
        if self.device.type != "cuda" or self.fused is None or max_tokens <= 0:
            return
        self.prefill_graphs = PrefillGraphs(max_tokens=max_tokens, max_seqs=max_seqs,
                                            **self._graph_settings(max_model_len))
        self.prefill_graphs.capture()

    def _graph_settings(self, max_model_len: int) -> dict:
        """What DecodeGraphs and PrefillGraphs both take: the forward they capture, block-table width, pool layout."""
        bs = self.pool.block_size
        return dict(forward=lambda *t: self.decode_forward(StepTensors(*t)), max_blocks=-(-max_model_len // bs),
                    block_size=bs, scratch_block=self.pool.scratch_block, device=self.device)

    def prepare(self, chunks: list[ScheduledChunk], rows: BlockRows | None = None) -> StepTensors:
        """The step's tensors on the device, from each chunk's sequence state (before it advances).

        `rows`: the block manager's BlockRows, where the step's block tables are gathered from.
        """
        arrays = host_step(chunks, self.pool.block_size, self.pool.scratch_block, rows)
        for graphs in (self.graphs, self.prefill_graphs):  # a step a graph replays goes straight into its buffers
            staged = graphs.stage(arrays, self.upload) if graphs is not None else None
            if staged is not None:
                return staged
        if self.device.type == "cpu":
            return StepTensors(*(torch.from_numpy(a) for a in arrays))
        tokens, positions, slots, tables, lens, starts, logits_for = arrays
        (tokens, positions, slots, logits_for), _ = aligned_views(
            [tokens, positions, slots, logits_for], np.int64, lambda values: self.upload(values, torch.long))
        (tables, lens, starts), _ = aligned_views(
            [tables, lens, starts], np.int32, lambda values: self.upload(values, torch.int32))
        return StepTensors(tokens, positions, slots, tables, lens, starts, logits_for)

    def upload(self, values: list[int] | np.ndarray, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """`values` on the device (copied into the front of `out` when given, else a new tensor); on CUDA through
        pinned host buffers and one non-blocking copy.

        A copy waits in the stream behind the step before it, so each dtype has a ring of buffers and a
        buffer is refilled only once its copy has run (several uploads later: no wait in practice).
        """
        host = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return host.to(self.device) if out is None else out[:host.numel()].copy_(host)
        ring = self._pinned.setdefault(dtype, [])
        turn = self._upload_turn.get(dtype, 0)
        self._upload_turn[dtype] = (turn + 1) % UPLOAD_RING
        if len(ring) <= turn or ring[turn][0].numel() < host.numel():
            buf = torch.empty(max(4096, 2 * host.numel()), dtype=dtype, pin_memory=True)
            ring[turn:turn + 1] = [(buf, None)]
        buf, done = ring[turn]
        if done is not None:
            done.synchronize()
        buf[:host.numel()].copy_(host)
        if out is None:
            out = buf[:host.numel()].to(self.device, non_blocking=True)
        else:
            out = out[:host.numel()].copy_(buf[:host.numel()], non_blocking=True)
        ring[turn] = (buf, self._record_event())
        return out

    def _record_event(self) -> torch.cuda.Event:
        """An event recorded now on the device's current stream (after the copies just queued there)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device_index))
        return event

    def download(self, values: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """A host copy of `values` (1-D) under way and the event after which it is complete (CPU: `values`, None).

        On CUDA the copy goes into a ring of pinned buffers allocated once (no pinned allocation per step),
        so a later step queued behind it never delays it; a buffer is reused DOWNLOAD_RING copies later.
        """
        if not values.is_cuda:
            return values, None
        turn = self._download_turn
        self._download_turn = (turn + 1) % DOWNLOAD_RING
        buf, done = self._downloads[turn]
        if done is not None:
            done.synchronize()  # read long ago in practice
        n = values.numel()
        if buf is None or buf.numel() < n or buf.dtype != values.dtype:
            buf = torch.empty(max(n, 512), dtype=values.dtype, pin_memory=True)
        host = buf[:n]
        host.copy_(values, non_blocking=True)
        event = self._record_event()
        self._downloads[turn] = (buf, event)
        return host, event

    def decode_forward(self, st: StepTensors) -> torch.Tensor:
        """Logits (len(st.logits_for), vocab) of one step, model dtype; a pure function of the tensors."""
        if self.fused is not None:
            return self.fused(st, self.pool, self._attend_fn(st))
        if self.cpu_decoder is not None:
            return self.cpu_decoder(st, self.pool)
        step = PagedStep(self.pool, st)
        return full_logits(self.model(st.tokens[None], st.positions[None], cache=step, logits_for=st.logits_for))

    def _attend_fn(self, st: StepTensors):
        """attend(layer, q, k_cache, v_cache) for the fused decoder: the Triton kernel where it runs (gpu_kernels),
        else the torch plan."""
        if self.gpu_kernels:
            def attend(layer_idx, q, k_cache, v_cache):
                return attention_gpu.paged_attention(q, k_cache, v_cache, st.block_tables, st.seq_lens,
                                                     st.query_start, q.shape[-1] ** -0.5)
            tokens = st.tokens.shape[0]  # decode of few sequences: one kernel from q|k|v (shapes only, no sync)
            if tokens == st.seq_lens.shape[0] and tokens <= decode_attention_gpu.MAX_TOKENS:
                attend.with_rotary = self._decode_attend_fn(st, attend)
            return attend
        plan = TorchAttentionPlan(st, self.pool.block_size)

        def attend_torch(layer_idx, q, k_cache, v_cache):
            d = q.shape[-1]
            return plan.attend(q, k_cache.view(-1, k_cache.shape[2], d), v_cache.view(-1, v_cache.shape[2], d),
                               d ** -0.5)
        return attend_torch

    @staticmethod
    def _decode_attend_fn(st: StepTensors, attend):
        """with_rotary(layer, qkv, cos, sin, k_cache, v_cache, hq, hkv) for a decode step: rotary, KV write and
        attention in one kernel, then the split combine (fourfold.infer.decode_attention_gpu), or the two-step
        path for head shapes it does not take."""
        def with_rotary(layer_idx, qkv, cos, sin, k_cache, v_cache, n_heads, n_kv_heads):
            d = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
            if not decode_attention_gpu.supports(d, n_heads, n_kv_heads):
                q = rotary_kv_write(qkv, st.positions, cos, sin, k_cache, v_cache, st.slot_mapping, n_heads,
                                    n_kv_heads)
                return attend(layer_idx, q, k_cache, v_cache)
            return decode_attention_gpu.decode_attention(qkv, st.positions, cos, sin, k_cache, v_cache,
                                                         st.slot_mapping, st.block_tables, st.seq_lens, d ** -0.5,
                                                         n_heads, n_kv_heads)
        return with_rotary

    @torch.inference_mode()
    def forward(self, st: StepTensors) -> torch.Tensor:
        """Logits of the sampling sequences in float32 (captured graphs replay decode steps and steps with prefill
        tokens)."""
        if self.graphs is not None and self.graphs.can_run(st):
            return self.graphs.run(st).float()
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(st):
            return self.prefill_graphs.run(st).float()
        return self.decode_forward(st).float()

    def forward_greedy(self, st: StepTensors) -> torch.Tensor | None:
        """For a step a graph replays: runs it and returns each sequence's greedy token (int64, the argmax taken
        inside the graph, no float32 logits made). Other steps: None, and nothing runs (call `forward`)."""
        if self.graphs is None or not self.graphs.can_run(st):
            return None
        self.graphs.run(st)
        return self.graphs.greedy_ids()
