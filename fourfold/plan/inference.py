"""Inference planning: weight and KV-cache bytes, how many sequences fit per TP/PP degree, decode speed.

    rows = plan_inference(model_cfg, device, efficiency, context=8192, gpus_per_node=8)
    for r in rows: r.tp, r.pp, r.max_sequences, r.tokens_per_s_batch1, r.tokens_per_s_max

Decode is memory-bound: each step reads this GPU's weights once and every sequence's KV cache, at the
HBM bandwidth times `efficiency.decode_bandwidth`; its matmuls (2 FLOPs per parameter per sequence) run at
the matmul efficiency, and the step takes the longer of the two, plus tp's two all-reduces per block (small
messages: latency) and pp's hand-offs. With pp, a batch-1 token passes every stage in turn; a full batch
is split into pp groups that keep every stage busy. Not measured yet: no recorded inference run exists, so
these are unvalidated predictions (docs/planner.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from fourfold.config import ModelConfig
from fourfold.models.llama import parameter_counts
from fourfold.plan.hardware import Device, Efficiency, Link

WEIGHT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5, "fp32": 4.0}
RESERVED_BYTES = 2.0 * 2**30
"""Per GPU: CUDA context, NCCL buffers, the forward's temporaries and the sampler's logits."""


@dataclass
class InferencePlan:
    """One (tp, pp) degree: bytes per GPU, the most sequences that fit at the context, decode tokens/s."""

    tp: int
    pp: int
    weight_bytes: float
    kv_bytes_per_sequence: float
    max_sequences: int
    tokens_per_s_batch1: float
    tokens_per_s_max: float


def kv_bytes_per_token(m: ModelConfig, kv_dtype: str = "bf16") -> float:
    """K and V of every layer for one token (all GPUs together)."""
    return 2 * m.n_layers * m.n_kv_heads * m.head_dim * WEIGHT_BYTES[kv_dtype]


def _decode_step(m: ModelConfig, dev: Device, eff: Efficiency, link: Link, tp: int, pp: int, batch: float,
                 context: int, weights_gpu: float, kv_gpu_token: float) -> float:
    """Seconds for one decode step of `batch` sequences through one pipeline stage."""
    read = weights_gpu + batch * context * kv_gpu_token
    memory = read / (dev.hbm_bandwidth * eff.decode_bandwidth)
    _, non_embedding = parameter_counts(m)
    flops = 2 * non_embedding / (tp * pp) * batch + 4 * batch * context * m.dim * m.n_layers / (tp * pp)
    compute = flops / (dev.flops("bf16") * eff.matmul)
    comm = 0.0
    if tp > 1:
        msg = batch * m.dim * 2
        # small messages: NCCL's low-latency one-shot all-reduce, about two link latencies each
        comm = 2 * m.n_layers / pp * (2 * link.latency + 2 * (tp - 1) / tp * msg / link.bandwidth)
    return max(memory, compute) + comm


def plan_inference(m: ModelConfig, dev: Device, eff: Efficiency, link: Link, context: int, gpus_per_node: int,
                   weight_dtype: str = "bf16", kv_dtype: str = "bf16", max_gpus: int = 0) -> list[InferencePlan]:
    """One row per (tp, pp) with tp inside a node dividing the kv heads, pp dividing the layers, up to
    `max_gpus` GPUs (0: one node for tp, any pp up to 16)."""
    total, _ = parameter_counts(m)
    weights = total * WEIGHT_BYTES[weight_dtype]
    kv_token = kv_bytes_per_token(m, kv_dtype)
    rows = []
    for tp in [d for d in range(1, gpus_per_node + 1) if gpus_per_node % d == 0 and m.n_kv_heads % d == 0
               and m.n_heads % d == 0]:
        for pp in [d for d in (1, 2, 4, 8, 16) if m.n_layers % d == 0]:
            if max_gpus and tp * pp > max_gpus:
                continue
            w_gpu, kv_gpu = weights / (tp * pp), kv_token / (tp * pp)
            free = dev.memory_bytes - RESERVED_BYTES - w_gpu
            seqs = int(free // (context * kv_gpu)) if free > 0 else 0
            one = pp * _decode_step(m, dev, eff, link, tp, pp, 1, context, w_gpu, kv_gpu)
            best = 0.0
            if seqs >= 1:
                group = max(1.0, seqs / pp)
                best = seqs / (pp * _decode_step(m, dev, eff, link, tp, pp, group, context, w_gpu, kv_gpu))
            rows.append(InferencePlan(tp, pp, w_gpu, kv_token * context, seqs, 1 / one if free > 0 else 0.0, best))
    return rows
