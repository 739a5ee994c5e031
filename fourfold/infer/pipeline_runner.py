"""Pipeline-parallel inference: each rank runs its stage's blocks over its own KV pool; hidden states go stage to stage.

    loaded = load_model(path, device, dtype, pp=(rank, world))           # this stage's chunk only
    runner = PipelineRunner(loaded.model, pool, device, stage_ranks=list(range(world)))

Every rank runs the same LLMEngine (same requests, same scheduler decisions, since they see the same
sampled tokens), so no rank sends the schedule: the first stage embeds the step's tokens, each stage
sends its hidden states (1, T, dim) to the next (point-to-point, gloo or NCCL), and the last stage's
logits are broadcast to every rank, which all sample the same tokens (same seeded generator). The
pool of a stage holds only its blocks' keys and values (`KVPool.first_layer`). This is the plain
pipeline (one step in flight): it serves a model larger than one device's memory, but while one stage
computes the others wait. fourfold.infer.pipeline_engine keeps every stage busy with micro-batches of
requests; it moves its hidden states and sampled ids through `StageLink` below (non-blocking sends).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fourfold.infer.kv_pool import KVPool
from fourfold.infer.model_runner import ModelRunner
from fourfold.infer.paged_attention import PagedStep
from fourfold.infer.step_tensors import StepTensors


class StageLink:
    """This rank's links in the pipeline `stage_ranks`: hidden states in from the previous stage and out to the
    next without blocking (isend/irecv, matched by a tag: the tick their step was scheduled at), and a
    broadcast from the last stage to every rank of `group`."""

    def __init__(self, stage_ranks: list[int], group: dist.ProcessGroup, device: torch.device):
        self.stage_ranks, self.group = stage_ranks, group
        self.stage = stage_ranks.index(dist.get_rank())
        self.last = len(stage_ranks) - 1
        self.device = device
        self.wire = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        self._recvs: dict[int, tuple[torch.Tensor, dist.Work]] = {}
        self._sends: list[tuple[torch.Tensor, dist.Work]] = []

    @staticmethod
    def _tag(key: int) -> int:
        return key % (1 << 20)

    def post_receive(self, key: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Start receiving the previous stage's output for step `key` (once per key)."""
        if key not in self._recvs:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            work = dist.irecv(buf, src=self.stage_ranks[self.stage - 1], group=self.group, tag=self._tag(key))
            self._recvs[key] = (buf, work)

    def receive(self, key: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The previous stage's output for step `key` (posting the receive now if it was not posted)."""
        self.post_receive(key, shape, dtype)
        buf, work = self._recvs.pop(key)
        work.wait()
        return buf

    def send(self, key: int, tensor: torch.Tensor) -> None:
        """Send this stage's output for step `key` to the next stage; returns at once (sends finished earlier
        are reaped here, so their buffers live until the next stage has them)."""
        tensor = tensor.contiguous()
        work = dist.isend(tensor, dst=self.stage_ranks[self.stage + 1], group=self.group, tag=self._tag(key))
        pending = []
        for item in self._sends:
            if not item[1].is_completed():
                pending.append(item)
        self._sends = pending + [(tensor, work)]

    def from_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as the last stage holds it, on every rank (others pass a buffer of the same shape)."""
        wire = tensor.to(self.wire)
        dist.broadcast(wire, src=self.stage_ranks[self.last], group=self.group)
        return wire.to(tensor.device)

    def drain(self) -> None:
        """Wait for every send still under way."""
        for _, work in self._sends:
            work.wait()
        self._sends = []


class PipelineRunner(ModelRunner):
    """A ModelRunner for one pipeline stage; `forward` returns the whole model's logits on every rank."""

    def __init__(self, chunk: nn.Module, pool: KVPool, device: torch.device, stage_ranks: list[int]):
        super().__init__(chunk, pool, device, fuse=False)
        self.stage_ranks = stage_ranks
        self.stage = stage_ranks.index(dist.get_rank())
        self.last = len(stage_ranks) - 1

    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Not captured: a step's point-to-point transfers sit between the stages' kernels."""

    def decode_forward(self, st: StepTensors) -> torch.Tensor:
        cfg = self.model.cfg
        dtype = self.pool.keys.dtype
        if self.stage == 0:
            x = st.tokens[None]
        else:
            x = torch.empty(1, st.tokens.shape[0], cfg.dim, dtype=dtype, device=self.device)
            dist.recv(x, src=self.stage_ranks[self.stage - 1])
        out = self.model(x, st.positions[None], cache=PagedStep(self.pool, st), logits_for=st.logits_for)
        if self.stage < self.last:
            dist.send(out.contiguous(), dst=self.stage_ranks[self.stage + 1])
            out = torch.empty(st.logits_for.shape[0], cfg.vocab_size, dtype=dtype, device=self.device)
        dist.broadcast(out, src=self.stage_ranks[self.last])
        return out
