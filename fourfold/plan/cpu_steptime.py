"""Step time on CPUs (gloo): the ops a step issues, each at its measured cost, plus gloo's latency and bandwidth.

    step = predict_cpu_step(cfg, world_size=2, costs=load_hardware().cpu)
    step.seconds, step.parts        # matmul, attention, elementwise, views, optimizer, comm, tp/fsdp overhead, bubble

On GPUs a step is FLOPs and bytes at calibrated efficiencies (fourfold/plan/steptime.py). On a CPU running a
small model it is not: fixed costs per op, small GEMMs far below the large-GEMM rate, cache-bound element-wise
ops and gloo's per-call latency decide it. So here the step is its op inventory (fourfold/plan/cpu_trace.py:
fourfold's own forward, loss, backward, clip and AdamW run on fake tensors of this rank's local shapes), each op
at the cost `fourfold plan calibrate` measured for its kind and size (fourfold/plan/cpu_costs.py), plus what
the layout adds, counted from the layout's own rules:

- DDP and ZeRO-1: one gloo all-reduce per gradient bucket (torch's 1 MiB first bucket, then bucket_mb);
  ZeRO-1 broadcasts every parameter from its owner (`fourfold.plan.layout.zero1_partition`) and steps
  AdamW tensor by tensor.
- FSDP2 (fsdp, cp, or dp next to tp): per unit (each block and the root) an all-gather per micro-batch, a
  second one in backward when the block reshards (`fourfold.parallel.fsdp.block_reshards_after_forward`), a
  reduce-scatter per step; the measured per-unit cost, plus the bytes.
- tensor parallel: every linear of `fourfold.parallel.tensor_plan` pays the measured DTensor cost; per block
  two all-reduces forward and two backward (sequence parallel: all-gathers and reduce-scatters).
- context parallel: ring attention passes K/V cp - 1 times forward and K/V and their gradients backward;
  all-gather attention gathers K and V and reduce-scatters their gradients.
- pipeline: the schedule replayed (`fourfold.plan.steptime.schedule_length`), one send and one receive per
  action.
Collectives are blocking on CPUs (both cores compute), so nothing overlaps. Ranks share the cores: with more
ranks x threads than cores, compute stretches by that ratio.
"""

from __future__ import annotations

import math

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from fourfold.config import Config
from fourfold.layout import data_parallel_strategy, grad_accumulation_steps, layout_sizes
from fourfold.models.llama import training_flops_per_token
from fourfold.parallel.fsdp import block_reshards_after_forward
from fourfold.parallel.tensor_plan import block_plan, outer_plan
from fourfold.plan.cpu_costs import CpuCosts
from fourfold.plan.cpu_parallel_trace import needs_parallel_trace
from fourfold.plan.cpu_pricing import ops_seconds
from fourfold.plan.cpu_traced_step import predict_traced_step
from fourfold.plan.cpu_trace import Op, micro_batch_ops, optimizer_ops
from fourfold.plan.layout import fsdp_shard_group, rank_chunks, zero1_partition
from fourfold.plan.steptime import StepTime, rank_layers, schedule_length

FIRST_BUCKET_BYTES = 1024**2
"""DDP's first gradient bucket (torch.distributed's default first bucket cap)."""


def threads_per_rank(world_size: int, cores: int) -> int:
    """torch's intra-op threads per rank: every core for one process, 1 under torchrun with several ranks
    (torchrun sets OMP_NUM_THREADS=1)."""
    return cores if world_size == 1 else 1


def _split(ops: tuple[Op, ...], costs: CpuCosts, threads: int, speedup: float) -> tuple[dict, dict]:
    """(forward, backward) seconds by class."""
    return (ops_seconds(tuple(o for o in ops if not o.backward), costs, threads, speedup),
            ops_seconds(tuple(o for o in ops if o.backward), costs, threads, speedup))


def _local_shapes(cfg: Config, pp_rank: int) -> list[tuple[tuple[int, ...], int | None]]:
    """(local shape, FSDP unit) of each parameter the rank holds, before data-parallel sharding."""
    return [(prm.shape, prm.unit) for chunk in rank_chunks(cfg, pp_rank) for prm in chunk.params]


def _linears(plan: dict) -> int:
    """How many modules of a tensor-parallel plan are column- or row-parallel (DTensor linears / embedding)."""
    return sum(isinstance(style, (ColwiseParallel, RowwiseParallel)) for style in plan.values())


def _bucket_count(grad_bytes: float, bucket_mb: float) -> int:
    rest = max(0.0, grad_bytes - FIRST_BUCKET_BYTES)
    return 1 + math.ceil(rest / (bucket_mb * 2**20))


def predict_cpu_step(cfg: Config, world_size: int, costs: CpuCosts, bf16_speedup: float = 1.0) -> StepTime:
    """Predicted seconds of one optimizer step of `cfg` on `world_size` CPU processes (gloo); `bf16_speedup` is
    the bf16 matmul rate over fp32's (the device's flops_bf16 / flops_fp32) for bf16/fp16 runs."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    sizes = layout_sizes(cfg)
    threads = threads_per_rank(world_size, costs.cores)
    crowd = max(1.0, world_size * threads / costs.cores)
    speedup = bf16_speedup if cfg.compute.precision in ("bf16", "fp16") else 1.0
    if world_size > 1 and needs_parallel_trace(cfg):
        try:
            return predict_traced_step(cfg, world_size, costs, threads, crowd, speedup)
        except RuntimeError:  # a process group exists (inside a run): the estimate below, from the layout's rules
            pass
    n_micro = grad_accumulation_steps(cfg)
    layers = rank_layers(cfg)
    last_rank = (p.pp * p.vpp - 1) % p.pp
    tokens = t.micro_batch * t.seq_len // p.cp
    act = 4 if cfg.compute.precision == "fp32" else 2
    comm = lambda kind, nbytes, ranks: costs.collective_seconds(kind, nbytes, ranks)  # noqa: E731

    # Per micro-batch on the busiest pipeline rank: its chunks' ops, and what tp / cp add per block.
    per_rank = []
    for r, chunks in enumerate(layers):
        fwd = bwd = 0.0
        parts: dict[str, float] = {}
        for c, n in enumerate(chunks):
            first, last = r == 0 and c == 0, r == last_rank and c == p.vpp - 1
            f, b = _split(micro_batch_ops(cfg, n, first, last), costs, threads, speedup)
            if p.cp > 1:  # the local queries attend over the whole sequence: cp times the traced attention
                f["attention"] *= p.cp
                b["attention"] *= p.cp
            for k in f:
                parts[k] = parts.get(k, 0.0) + f[k] + b[k]
            fwd_c, bwd_c = sum(f.values()) * crowd, sum(b.values()) * crowd
            extra_f = extra_b = 0.0
            if p.tp > 1:
                linears = n * _linears(block_plan(p.sequence_parallel)) + \
                    _linears(outer_plan(p.sequence_parallel, first, last))
                kinds = ("all_gather", "reduce_scatter") if p.sequence_parallel else ("all_reduce", "all_reduce")
                one = sum(comm(k, tokens * m.dim * act, p.tp) for k in kinds)
                tp = linears * costs.tp_linear + n * 2 * one
                parts["tp"] = parts.get("tp", 0.0) + tp
                extra_f, extra_b = extra_f + tp / 2, extra_b + tp / 2
            if p.cp > 1:
                kv = tokens * 2 * (m.n_kv_heads // p.tp) * m.head_dim * act
                if p.cp_method == "ring":
                    cp_f = n * (p.cp - 1) * comm("p2p", kv, 2)
                    cp_b = 2 * cp_f
                else:
                    cp_f = n * comm("all_gather", kv * p.cp, p.cp)
                    cp_b = n * comm("reduce_scatter", kv * p.cp, p.cp)
                parts["cp"] = parts.get("cp", 0.0) + cp_f + cp_b
                extra_f, extra_b = extra_f + cp_f, extra_b + cp_b
            fwd, bwd = fwd + fwd_c + extra_f, bwd + bwd_c + extra_b
        per_rank.append((fwd, bwd, parts))
    busiest = max(range(p.pp), key=lambda r: per_rank[r][0] + per_rank[r][1])
    fwd, bwd, parts = per_rank[busiest]
    parts = {k: v * n_micro for k, v in parts.items()}
    compute = n_micro * (fwd + bwd)
    if cfg.compute.recompute == "full":  # backward replays each block's forward
        compute += n_micro * fwd
        parts["recompute"] = n_micro * fwd
    if p.pp > 1:
        units = schedule_length(p.pp_schedule, p.pp, p.vpp, n_micro)  # in units of one chunk's forward
        per_unit = (fwd + bwd) / (3 * p.vpp)  # forward 1 unit, backward 2
        body = units * per_unit + 2 * n_micro * p.vpp * comm("p2p", tokens * m.dim * act / p.tp, 2)
    else:
        body = compute
    parts["bubble"] = max(0.0, body - compute)

    # Data parallel: gradient buckets, FSDP units, ZeRO-1's broadcasts; then clip and AdamW on the local shard.
    strategy = data_parallel_strategy(p)
    shapes = _local_shapes(cfg, busiest)
    numels = [math.prod(s) for s, _ in shapes]
    param_bytes = 4 * sum(numels)
    dp_comm = 0.0
    opt_shapes = [s for s, _ in shapes]
    foreach = True
    if strategy in ("ddp", "zero1"):
        ranks = p.dp if strategy == "ddp" else p.fsdp
        buckets = _bucket_count(param_bytes, p.bucket_mb)
        dp_comm = buckets * comm("all_reduce", param_bytes / buckets, ranks)
        if strategy == "zero1":
            from_layout = [prm for chunk in rank_chunks(cfg, busiest) for prm in chunk.params]
            owner = zero1_partition(from_layout, ranks)
            dp_comm += sum(comm("broadcast", 4 * n, ranks) for n in numels)
            opt_shapes = [prm.shape for prm, o in zip(from_layout, owner) if o == 0]
            foreach = False
    elif strategy == "fsdp":
        shards, _ = fsdp_shard_group(cfg, {d: 0 for d in sizes})
        units: dict[int | None, int] = {}
        for (shape, unit), n in zip(shapes, numels):
            units[unit] = units.get(unit, 0) + n
        blocks = [u for u in units if u is not None]
        gathers = 0.0
        for u, n in units.items():
            again = u is not None and block_reshards_after_forward(p, sorted(blocks).index(u), len(blocks))
            gather = costs.collective_seconds("all_gather", 4 * n, shards, latency=False)
            gathers += n_micro * (1 + again) * gather + costs.collective_seconds("reduce_scatter", 4 * n, shards,
                                                                                 latency=False)
        dp_comm = gathers + len(units) * n_micro * costs.fsdp_unit
        if p.dp > 1 and shards > 1:
            dp_comm += comm("all_reduce", param_bytes / shards, p.dp)
        opt_shapes = [(-(-s[0] // shards),) + tuple(s[1:]) for s in opt_shapes]
    parts["dp_comm"] = dp_comm
    opt = ops_seconds(optimizer_ops(tuple(tuple(s) for s in opt_shapes), foreach, cfg.optim.grad_clip > 0),
                      costs, threads)
    parts["optimizer"] = sum(opt.values()) * crowd
    sync = comm("all_reduce", 8, world_size) * (2 if strategy != "none" or p.tp > 1 else 1)  # loss (+ norm)
    parts["sync"] = sync
    seconds = body + dp_comm + parts["optimizer"] + sync
    tokens_step = t.global_batch * t.seq_len
    flops = tokens_step * training_flops_per_token(m, t.seq_len)
    return StepTime(seconds, parts, tokens_step, flops)

