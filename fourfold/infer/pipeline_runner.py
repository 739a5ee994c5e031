"""Pipeline-parallel inference: each rank runs its stage's blocks over its own KV pool; hidden states go stage to stage.

    loaded = load_model(path, device, dtype, pp=(rank, world))           # this stage's chunk only
    runner = PipelineRunner(loaded.model, pool, device, stage_ranks=list(range(world)))

Every rank runs the same LLMEngine (same requests, same scheduler decisions, since they see the same
sampled tokens), so no rank sends the schedule: the first stage embeds the step's tokens, each stage
sends its hidden states (1, T, dim) to the next (point-to-point, gloo or NCCL), and the last stage's
logits are broadcast to every rank, which all sample the same tokens (same seeded generator). The
pool of a stage holds only its blocks' keys and values (`KVPool.first_layer`). This is the plain
pipeline (one step in flight): it serves a model larger than one device's memory; overlapping
micro-batches of requests across stages is not done yet.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fourfold.infer.kv_pool import KVPool
from fourfold.infer.model_runner import ModelRunner
from fourfold.infer.paged_attention import PagedStep
from fourfold.infer.step_tensors import StepTensors


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
