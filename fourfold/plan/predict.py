"""One layout's prediction: step time, peak memory per GPU, whether it fits, tokens/s per GPU and MFU.

    pred = predict(cfg, world_size=64, hw=load_hardware(), device="h100", gpus_per_node=8, interconnect="ib400")
    pred.step.seconds, pred.peak_bytes, pred.fits, pred.tokens_per_s_per_gpu, pred.mfu

Peak memory is `fourfold.plan.memory.estimate_memory`'s total for the rank that holds the most (what the
CUDA allocator's max_memory_allocated reports); whether it fits adds the allocator's fragmentation and the
CUDA and NCCL context, which the allocator does not count.
"""

from __future__ import annotations

from dataclasses import dataclass

from fourfold.config import Config
from fourfold.plan.cpu_steptime import predict_cpu_step
from fourfold.plan.hardware import Hardware
from fourfold.plan.layout import rank_of
from fourfold.plan.memory import MemoryEstimate, estimate_memory
from fourfold.plan.steptime import Cluster, StepTime, compute_dtype, predict_step

FRAGMENTATION = 0.05
"""The caching allocator's reserved-but-unused share on top of the allocated peak."""
CONTEXT_BYTES = 2.0 * 2**30
"""CUDA context, cuBLAS workspaces and NCCL buffers: memory outside the allocator's count."""


@dataclass
class Prediction:
    """Predicted step time and memory of one layout on one cluster."""

    step: StepTime
    memory: MemoryEstimate | None
    world_size: int
    device_bytes: float
    peak_flops: float

    @property
    def peak_bytes(self) -> int:
        """Allocated peak per GPU (the rank that holds the most)."""
        return self.memory.total if self.memory is not None else 0

    @property
    def needed_bytes(self) -> float:
        """Device memory the run needs: the allocated peak, fragmentation and the contexts."""
        return self.peak_bytes * (1 + FRAGMENTATION) + CONTEXT_BYTES

    @property
    def fits(self) -> bool:
        """Whether the layout fits the device's memory."""
        return self.needed_bytes <= self.device_bytes

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Predicted trained tokens per second per GPU."""
        return self.step.tokens_per_s_per_gpu(self.world_size)

    @property
    def mfu(self) -> float:
        """Predicted model FLOPs utilisation (bf16 dense peak, the trainer's definition)."""
        return self.step.mfu(self.world_size, self.peak_flops)


def peak_rank_memory(cfg: Config, world_size: int) -> MemoryEstimate:
    """The memory estimate of the rank that holds the most. Deep pipelines are estimated on their first stage
    (the most micro-batches in flight, the embedding) and last (the head and the loss) only: a middle stage
    holds fewer micro-batches than the first and no embedding or head."""
    p = cfg.parallel
    if p.pp <= 2:
        return estimate_memory(cfg, world_size)
    ends = [estimate_memory(cfg, world_size, rank_of(cfg, {"pp": stage})) for stage in (0, p.pp - 1)]
    return max(ends, key=lambda e: e.total)


def cluster_for(hw: Hardware, device: str, gpus_per_node: int, interconnect: str) -> Cluster:
    """The Cluster of `device`s (see fourfold.plan.steptime.Cluster)."""
    return Cluster.build(hw, device, gpus_per_node, interconnect)


def predict(cfg: Config, world_size: int, hw: Hardware, device: str, gpus_per_node: int = 8,
            interconnect: str = "ib400", optimizer: bool = True, memory: bool = True) -> Prediction:
    """Predict `cfg` on `world_size` GPUs; `optimizer` False leaves the optimizer step out (a timed loop
    without it); `memory` False skips the memory model (the search fills it in for the fastest only)."""
    cluster = cluster_for(hw, device, gpus_per_node, interconnect)
    if cluster.device.name == "cpu" and hw.cpu is not None:  # per-op costs and gloo: fourfold/plan/cpu_steptime.py
        bf16 = cluster.device.flops("bf16") / cluster.device.flops("fp32")
        step = predict_cpu_step(cfg, world_size, hw.cpu, bf16_speedup=bf16)
    else:
        step = predict_step(cfg, world_size, cluster)
    if not optimizer:
        step.seconds -= step.parts.pop("optimizer")
    est = peak_rank_memory(cfg, world_size) if memory else None
    dtype = compute_dtype(cfg)
    peak = cluster.device.flops("bf16" if dtype == "fp16" else dtype)
    return Prediction(step, est, world_size, cluster.device.memory_bytes, peak)
