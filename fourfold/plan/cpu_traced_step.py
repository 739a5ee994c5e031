"""Step time on CPUs of tensor-parallel, context-parallel and FSDP2 layouts, from rank 0's own traced step.

    step = predict_traced_step(cfg, world_size=2, costs=costs, threads=1, crowd=1.0, speedup=1.0)

fourfold/plan/cpu_parallel_trace.py records the ops of one micro-batch and of the clip and AdamW step on the
layout's parallelised model over a fake process group; here they are priced (fourfold/plan/cpu_pricing.py:
each op at its class's cost times the calibrated step factor, each DTensor op plus `dtensor_op`), the traced
collectives charged at gloo's alpha-beta times the in-step factor, and each FSDP2 unit its hooks' cost per
micro-batch. Recompute is in the trace (the model carries its checkpoint wrappers). Collectives are blocking on
CPUs, so nothing overlaps.

Tracing costs about a second per layout for a small model, most of it in the blocks, which a parallel layout
repeats alike (every block but the last, which FSDP2 keeps gathered after forward): a model of more than two
blocks is traced with one and with two, and its price extrapolated linearly in the number of blocks.
"""

from __future__ import annotations

from dataclasses import replace

from fourfold.config import Config
from fourfold.layout import data_parallel_strategy, grad_accumulation_steps
from fourfold.models.llama import training_flops_per_token
from fourfold.plan.cpu_costs import CpuCosts
from fourfold.plan.cpu_parallel_trace import parallel_step_ops
from fourfold.plan.cpu_pricing import collectives_seconds, ops_seconds
from fourfold.plan.steptime import StepTime


def _priced(cfg: Config, world_size: int, costs: CpuCosts, threads: int, speedup: float) -> dict[str, float]:
    """Seconds of one micro-batch by class (forward and backward), its collectives, and the optimizer step's
    ops and collectives, of `cfg` as traced (no crowding, no gradient accumulation)."""
    micro, optim = parallel_step_ops(cfg, world_size)
    parts = ops_seconds(micro, costs, threads, speedup)
    parts["comm"] = collectives_seconds(micro, costs)
    parts["optimizer"] = sum(ops_seconds(optim, costs, threads).values())
    parts["optimizer_comm"] = collectives_seconds(optim, costs)
    return parts


def _priced_by_blocks(cfg: Config, world_size: int, costs: CpuCosts, threads: int, speedup: float) -> dict:
    """`_priced` of the whole model: traced as it is up to two blocks, else extrapolated from one and two."""
    layers = cfg.model.n_layers
    if layers <= 2:
        return _priced(cfg, world_size, costs, threads, speedup)
    one, two = (_priced(replace(cfg, model=replace(cfg.model, n_layers=n)), world_size, costs, threads, speedup)
                for n in (1, 2))
    return {k: one[k] + (layers - 1) * (two[k] - one[k]) for k in one}


def predict_traced_step(cfg: Config, world_size: int, costs: CpuCosts, threads: int, crowd: float,
                        speedup: float) -> StepTime:
    """Predicted seconds of one optimizer step of `cfg` (tp, cp or FSDP2, no pipeline) on `world_size` ranks:
    `threads` per rank, compute stretched by `crowd` (ranks x threads over the cores), `speedup` the low-precision
    matmul rate over fp32's. RuntimeError when a process group exists (the trace needs its own, fake one)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    n_micro = grad_accumulation_steps(cfg)
    priced = _priced_by_blocks(cfg, world_size, costs, threads, speedup)
    parts = {k: n_micro * crowd * priced[k] for k in ("matmul", "attention", "elementwise", "views", "dtensor")}
    compute = sum(parts.values())
    parts["comm"] = n_micro * priced["comm"]
    units = m.n_layers + 1 if data_parallel_strategy(p) == "fsdp" else 0  # each block and the root
    parts["fsdp_hooks"] = n_micro * units * costs.fsdp_hook
    parts["optimizer"] = priced["optimizer"] * crowd + priced["optimizer_comm"]
    parts["sync"] = costs.collective_seconds("all_reduce", 8, world_size) * 2  # the loss divisor and the guard
    seconds = compute + parts["comm"] + parts["fsdp_hooks"] + parts["optimizer"] + parts["sync"]
    tokens_step = t.global_batch * t.seq_len
    return StepTime(seconds, parts, tokens_step, tokens_step * training_flops_per_token(m, t.seq_len))
