"""Step-time prediction: one optimizer step of a config on a cluster, from FLOPs, bytes and the schedule.

    cluster = Cluster.build(load_hardware(), "h100", gpus_per_node=8, interconnect="ib400")
    step = predict_step(cfg, world_size=64, cluster=cluster)
    step.seconds, step.parts          # total, and where it goes (compute, recompute, comm, bubble, optimizer)

Per micro-batch and pipeline rank: matmul FLOPs (blocks split by tp, the head on the last stage) at the
calibrated matmul efficiency of the compute dtype (fp8 for float8 block linears); causal attention FLOPs
(split by tp and cp) at the attention efficiency, backward 2.5x forward; element-wise traffic (norms,
residuals, RoPE, SwiGLU, casts, the loss) over the memory bandwidth, eager or compiled; recompute repeats
the forward of the recomputed blocks (full, every-N) or their element-wise work (selective). Communication
is message bytes over the link the group spans (tp innermost, then cp, fsdp, dp, pp as fourfold.layout
orders them; a group wider than a node crosses the inter-node link): tp's all-reduces (or all-gather +
reduce-scatter under SP) are exposed; ring attention's K/V exchange hides behind attention; FSDP's
gathers and reduce-scatters and DDP's all-reduce hide behind compute up to the overlap fraction. The
pipeline is timed by replaying each rank's compute order from `fourfold.parallel.pipeline.schedules`
with these per-micro-batch costs. Then the optimizer (fused AdamW: a memory-bound pass over the local
shard) and a fixed per-step overhead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from fourfold.config import Config
from fourfold.layout import DIM_ORDER, data_parallel_strategy, grad_accumulation_steps, layout_sizes
from fourfold.models.llama import training_flops_per_token
from fourfold.parallel.pipeline.schedules import SCHEDULES
from fourfold.parallel.pipeline.split import stage_layer_counts
from fourfold.plan.hardware import Device, Efficiency, Hardware, Link
from fourfold.recompute import recomputed_blocks

BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}
STEP_OVERHEAD_S = 0.004
"""Per optimizer step: the loop, the gradient-norm reduction, the learning-rate update."""

ZB_SPLIT = 1.3
"""Zero-bubble's input- and weight-gradient passes together cost this many backwards (fitted: bench/pipeline.py)."""



@dataclass(frozen=True)
class Cluster:
    """The GPUs of a run: one device kind, its in-node link, the inter-node link, GPUs per node."""

    device: Device
    intra: Link
    inter: Link
    gpus_per_node: int
    efficiency: Efficiency

    @staticmethod
    def build(hw: Hardware, device: str, gpus_per_node: int, interconnect: str = "ib400") -> "Cluster":
        """The cluster of `device`s, `gpus_per_node` to a node, nodes joined by `interconnect`."""
        dev = hw.device(device)
        return Cluster(dev, hw.link(dev.intra_node), hw.link(interconnect), max(1, gpus_per_node), hw.efficiency)

    def group_link(self, sizes: dict[str, int], dim: str) -> Link:
        """The link the slowest hop of a `dim` group crosses (groups are strided by the dims inside them)."""
        stride = 1
        for name in DIM_ORDER[DIM_ORDER.index(dim) + 1:]:
            stride *= sizes[name]
        return self.intra if stride * sizes[dim] <= self.gpus_per_node else self.inter

    def collective(self, link: Link, n: int, nbytes: float, kind: str) -> float:
        """Seconds of a ring collective over `n` ranks moving a `nbytes` tensor: all_reduce, all_gather,
        reduce_scatter (nbytes = the full tensor) or p2p (nbytes sent once)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        bw = link.bandwidth * self.efficiency.collective
        if kind == "p2p":
            return nbytes / bw + link.latency
        factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
        steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
        return factor * nbytes / bw + steps * link.latency


@dataclass
class StepTime:
    """Predicted seconds of one optimizer step, and its parts."""

    seconds: float
    parts: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    model_flops: float = 0.0

    def tokens_per_s_per_gpu(self, world: int) -> float:
        """Trained tokens per second per GPU."""
        return self.tokens / self.seconds / world

    def mfu(self, world: int, peak: float) -> float:
        """Model FLOPs utilisation against `peak` FLOP/s per GPU."""
        return self.model_flops / self.seconds / (world * peak) if peak else 0.0


def compute_dtype(cfg: Config) -> str:
    """The dtype matmuls run in: the autocast dtype under bf16/fp16, else the master dtype (fp32 without TF32)."""
    return {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "fp64": "fp64"}[cfg.compute.precision]


def _block_matmul_params(cfg: Config) -> int:
    m = cfg.model
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    return m.dim * q + 2 * m.dim * kv + q * m.dim + 3 * m.dim * m.ffn_dim


def _elementwise_bytes_per_token(cfg: Config) -> tuple[float, float]:
    """(per block, for the loss) element-wise bytes one token moves, forward + backward, eager op by op.

    Per block: two RMSNorms in fp32 (about 8 passes of 4 bytes each over dim), two fp32 residual adds,
    the casts of the linear inputs, RoPE over q and k (6 passes of 2 bytes), SwiGLU (5 passes of 2 bytes
    over ffn); backward about twice forward. The loss: logits upcast, log-softmax and its gradient (about
    10 passes of 4 bytes per vocabulary entry). The efficiency table scales these for eager or compiled."""
    m, p = cfg.model, cfg.parallel
    d, q, k = m.dim, m.n_heads * m.head_dim // p.tp, m.n_kv_heads * m.head_dim // p.tp
    f = m.ffn_dim / p.tp
    d_share = d / p.tp if p.sequence_parallel and p.tp > 1 else d
    forward = 100 * d_share + 12 * (q + k) + 10 * f
    return 3 * forward, 40 * m.vocab_size / p.tp


@dataclass
class StageCost:
    """Seconds of one micro-batch on one pipeline rank: forward, backward (recompute included), and parts."""

    forward: float
    backward: float
    parts: dict[str, float]


def stage_cost(cfg: Config, cluster: Cluster, layers: int, first: bool, last: bool) -> StageCost:
    """Forward and backward seconds of one micro-batch through `layers` blocks (plus the head when `last`)."""
    m, t, p, dev, eff = cfg.model, cfg.train, cfg.parallel, cluster.device, cluster.efficiency
    sizes = layout_sizes(cfg)
    dtype = compute_dtype(cfg)
    tokens = t.micro_batch * t.seq_len / p.cp
    skinny = tokens / (tokens + eff.matmul_tokens_half)
    mm_peak = dev.flops(dtype) * eff.matmul * skinny
    block_peak = dev.flops("fp8") * eff.fp8_matmul * skinny if cfg.quant.float8 and dev.flops("fp8") else mm_peak
    blocks_mm = 2 * tokens * _block_matmul_params(cfg) / p.tp * layers / block_peak
    head_mm = 2 * tokens * m.vocab_size * m.dim / p.tp / mm_peak if last else 0.0
    attn_flops = 2 * t.micro_batch * (t.seq_len / p.cp) * t.seq_len * m.n_heads * m.head_dim / p.tp  # causal
    s_rank = t.seq_len / p.cp
    slowdown = (eff.ring_attention if p.cp_method == "ring" else eff.allgather_attention) if p.cp > 1 else 1.0
    attn_peak = dev.flops(dtype) * eff.attention * s_rank / (s_rank + eff.attention_seq_half) / slowdown
    attn_fwd = attn_flops * layers / attn_peak
    per_block, per_loss = _elementwise_bytes_per_token(cfg)
    scale = eff.elementwise_compiled if cfg.compute.compile else eff.elementwise_eager
    ew = tokens * (per_block * layers + (per_loss if last else 0)) * scale / dev.hbm_bandwidth
    if cfg.compute.compile and cfg.compute.compile_scope == "blocks":
        ew += layers * eff.compile_block_boundary
    ew_fwd, ew_bwd = ew / 3, 2 * ew / 3

    act = 2 if dtype in ("bf16", "fp16") else BYTES[dtype]
    tp_comm = cp_comm = 0.0
    if p.tp > 1:  # 2 all-reduces (or all-gather + reduce-scatter) forward, 2 backward, each T x dim
        link = cluster.group_link(sizes, "tp")
        one = cluster.collective(link, p.tp, tokens * m.dim * act, "all_reduce")
        tp_comm = layers * 4 * one
    if p.cp > 1:
        link = cluster.group_link(sizes, "cp")
        kv = tokens * 2 * m.n_kv_heads * m.head_dim / p.tp * act
        if p.cp_method == "ring":  # K/V around the ring forward; K/V and their gradients backward
            ring = (p.cp - 1) * (kv / (link.bandwidth * eff.collective) + link.latency)
            cp_comm = layers * (max(0.0, ring - eff.overlap * attn_fwd / layers)
                                + max(0.0, 2 * ring - eff.overlap * 2.5 * attn_fwd / layers))
        else:
            cp_comm = layers * 2 * cluster.collective(link, p.cp, kv * p.cp, "all_gather")

    ew_block_fwd = per_block * layers * tokens * scale / dev.hbm_bandwidth / 3
    if p.tp > 1 and not cfg.compute.compile:
        # Eager DTensor: each block's ops are dispatched on the CPU (redistributions included); the GPU waits
        # when a block's kernels take less time than their dispatch.
        dispatch = layers * (eff.tp_sp_block_overhead if p.sequence_parallel else eff.tp_block_overhead)
        gpu = 3 * blocks_mm + 3.5 * attn_fwd + 3 * ew_block_fwd
        tp_comm += max(0.0, dispatch - gpu)
    forward = blocks_mm + head_mm + attn_fwd + ew_fwd + tp_comm / 2 + cp_comm / 3
    backward = 2 * (blocks_mm + head_mm) + 2.5 * attn_fwd + ew_bwd + tp_comm / 2 + 2 * cp_comm / 3
    mode = cfg.compute.recompute
    share = len(recomputed_blocks(mode, layers)) / layers if layers else 0.0
    if mode == "selective":  # matmul and attention outputs kept: about half the element-wise forward again
        recompute = 0.5 * ew_block_fwd
    else:  # full and every-N: the whole forward of the recomputed blocks, their collectives included
        recompute = share * (blocks_mm + attn_fwd + ew_block_fwd + tp_comm / 2 + cp_comm / 3)
    parts = {"matmul": 3 * (blocks_mm + head_mm), "attention": 3.5 * attn_fwd, "elementwise": ew,
             "tp_comm": tp_comm, "cp_comm": cp_comm, "recompute": recompute}
    return StageCost(forward, backward + recompute, parts)


@functools.lru_cache(maxsize=4096)
def schedule_length(schedule: str, pp: int, vpp: int, n_micro: int) -> float:
    """Makespan of `schedule` in units of one micro-batch's forward through one chunk (backward 2 units;
    zero-bubble's BI and BW ZB_SPLIT units each), replaying every rank's compute order from
    `fourfold.parallel.pipeline.schedules`: each compute waits for its rank and its input."""
    orders = [SCHEDULES[schedule](pp, vpp, n_micro, r) for r in range(pp)]
    cost = {"F": 1.0, "B": 2.0, "BI": ZB_SPLIT, "BW": ZB_SPLIT}
    last = pp * vpp - 1
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    pos = [0] * pp
    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                stage = a.chunk * pp + r
                need = ("F", a.microbatch, stage - 1) if a.kind == "F" and stage > 0 else \
                    ("B", a.microbatch, stage + 1) if a.kind in ("B", "BI") and stage < last else None
                if need is not None and need not in done:
                    break
                free[r] = max(free[r], done[need] if need else 0.0) + cost[a.kind]
                if a.kind != "BW":
                    done[("F" if a.kind == "F" else "B", a.microbatch, stage)] = free[r]
                pos[r] += 1
                progressed = True
    return max(free)


def pipeline_makespan(cfg: Config, busiest: float, n_micro: int, overhead: float) -> float:
    """Seconds from the first forward to the last backward: the busiest rank's compute (`busiest` seconds for
    all its micro-batches) stretched by the schedule's bubble, plus `overhead` per micro-batch and chunk
    on the critical path."""
    p = cfg.parallel
    zero_bubble = p.pp_schedule == "zero-bubble"
    ratio = schedule_length(p.pp_schedule, p.pp, p.vpp, n_micro) / (n_micro * p.vpp * (1 + 2 * (ZB_SPLIT if zero_bubble else 1)))
    actions = 3 if zero_bubble else 2  # per micro-batch: F and B, or F, BI and BW (each chunk's share 1/vpp)
    return (busiest + overhead * n_micro * actions) * ratio

def rank_layers(cfg: Config) -> list[list[int]]:
    """Blocks of each chunk of each pipeline rank: [rank][chunk]."""
    p = cfg.parallel
    counts = stage_layer_counts(cfg.model.n_layers, p.pp, p.vpp, p.pp_layers) if p.pp * p.vpp > 1 \
        else [cfg.model.n_layers]
    return [[counts[c * p.pp + r] for c in range(p.vpp)] for r in range(p.pp)]


def local_params(cfg: Config) -> float:
    """Parameters one rank holds before data-parallel sharding: its pipeline share, split by tp (the largest rank)."""
    m, p = cfg.model, cfg.parallel
    block = _block_matmul_params(cfg) / p.tp + 2 * m.dim
    per_rank = max(sum(chunks) for chunks in rank_layers(cfg)) * block
    ends = m.vocab_size * m.dim / p.tp * (1 if p.pp > 1 else (1 if m.tie_embeddings else 2))
    return per_rank + ends + m.dim  # the final norm


def predict_step(cfg: Config, world_size: int, cluster: Cluster) -> StepTime:
    """Predicted seconds of one optimizer step of `cfg` on `world_size` GPUs of `cluster` (layout assumed valid)."""
    m, t, p, eff, dev = cfg.model, cfg.train, cfg.parallel, cluster.efficiency, cluster.device
    sizes = layout_sizes(cfg)
    n_micro = grad_accumulation_steps(cfg)
    layers = rank_layers(cfg)
    last_rank = (p.pp * p.vpp - 1) % p.pp
    costs = [[stage_cost(cfg, cluster, n, r == 0 and c == 0, r == last_rank and c == p.vpp - 1)
              for c, n in enumerate(chunks)] for r, chunks in enumerate(layers)]
    busiest = max(range(p.pp), key=lambda r: sum(c.forward + c.backward for c in costs[r]))
    compute = n_micro * sum(c.forward + c.backward for c in costs[busiest])
    if p.pp > 1:
        split = ZB_SPLIT if p.pp_schedule == "zero-bubble" else 1.0  # BI + BW cost more than one B
        busy = n_micro * sum(c.forward + c.backward * split for c in costs[busiest])
        body = pipeline_makespan(cfg, busy, n_micro, eff.pp_action_overhead)
        p2p = cluster.collective(cluster.group_link(sizes, "pp"), 2,
                                 t.micro_batch * t.seq_len / p.cp / p.tp * m.dim * 2, "p2p")
        body += 2 * p2p * (n_micro + p.pp - 1) * p.vpp
    else:
        body = n_micro * (costs[0][0].forward + costs[0][0].backward)
    parts = {k: n_micro * sum(c.parts[k] for c in costs[busiest]) for k in costs[0][0].parts}
    parts["bubble"] = max(0.0, body - compute)

    strategy = data_parallel_strategy(p)
    local = local_params(cfg)
    master = 8 if cfg.compute.precision == "fp64" else 4
    param_b = BYTES[p.param_dtype] if p.param_dtype != "fp32" else master
    reduce_b = BYTES[p.reduce_dtype] if p.reduce_dtype != "fp32" else master
    dp_comm = 0.0
    shards = 1
    if strategy == "ddp":
        ar = cluster.collective(cluster.group_link(sizes, "dp"), p.dp, local * reduce_b, "all_reduce")
        dp_comm = max(ar - eff.overlap * compute, eff.comm_exposed * ar)
        if reduce_b != master:  # the comm hook's cast, divide and copy back: four passes over the gradients
            dp_comm += local * (2 * master + 2 * reduce_b) / (dev.hbm_bandwidth * eff.optimizer)
    elif strategy in ("fsdp", "zero1"):
        dims = [d for d in ("fsdp", "cp") if sizes[d] > 1] or ["dp"]
        shards = 1
        for d in dims:
            shards *= sizes[d]
        link = cluster.group_link(sizes, dims[0])
        if strategy == "zero1":
            dp_comm = cluster.collective(link, shards, local * reduce_b, "all_reduce") + \
                cluster.collective(link, shards, local * master, "all_gather")
        else:
            gathers = 2 if p.reshard_after_forward else 1
            gather = cluster.collective(link, shards, local * param_b, "all_gather")
            scatter = cluster.collective(link, shards, local * reduce_b, "reduce_scatter")
            total = n_micro * gathers * gather + scatter
            hidden = eff.overlap * compute
            first_block = gather / max(1, sum(layers[0]))
            dp_comm = max(total - hidden, eff.comm_exposed * total) + first_block * n_micro
            if p.dp > 1 and shards > 1:  # HSDP: the shards' gradients all-reduced over the replicas
                dp_comm += cluster.collective(cluster.group_link(sizes, "dp"), p.dp, local / shards * reduce_b,
                                              "all_reduce")
    parts["dp_comm"] = dp_comm
    opt_params = local / shards if strategy in ("fsdp", "zero1") else local
    parts["optimizer"] = opt_params * 7 * master / (dev.hbm_bandwidth * eff.optimizer)
    parts["overhead"] = STEP_OVERHEAD_S
    seconds = body + dp_comm + parts["optimizer"] + STEP_OVERHEAD_S
    tokens = t.global_batch * t.seq_len
    flops = tokens * training_flops_per_token(m, t.seq_len)
    return StepTime(seconds, parts, tokens, flops)
