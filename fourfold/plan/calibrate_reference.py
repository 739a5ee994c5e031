"""`fourfold plan calibrate` on CPUs, the reference steps: what a real step costs beyond its ops' micro-benchmarks.

    table |= reference_table(table)   # step_factor_1, step_factor_n, dtensor_op, fsdp_hook

The rate tables (fourfold/plan/calibrate_cpu.py) time each kind of op alone, on warm square operands. A real
step's ops read operands written long before (cold), touch fresh pages, and sit between autograd's and Python's
own work; tensor parallel wraps them in DTensor, FSDP2 in hooks. So the calibration also runs one small
*reference* Llama step (REFERENCE: not a model of the validation table) on real tensors, forward, loss,
backward, clip and AdamW, and compares the time it takes with the price the step model gives its traced ops:
- `step_factor_1`: that ratio for the one-process step on one thread (CPU time of this thread, the fastest of
  several steps, so other processes disturb it little); `step_factor_n` on every core (wall time).
- `dtensor_op`: the same step under tensor parallel (tp 2, sequence parallel) over torch's fake process group
  (rank 0 only, collectives return at once), less its ops' price, per DTensor op of its trace.
- `fsdp_hook`: the same step under FSDP2 (2 shards), less its ops' price (FSDP2's copies in and out included),
  per FSDP unit.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from fourfold.config import Config, build_config
from fourfold.plan.cpu_costs import CpuCosts
from fourfold.plan.cpu_parallel_trace import fake_process_group, parallel_model, step_function, trace_in_group
from fourfold.plan.cpu_pricing import ops_seconds
from fourfold.plan.cpu_trace import Op

REFERENCE = {"model.dim": "192", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2",
             "model.ffn_dim": "512", "model.vocab_size": "384", "model.max_seq_len": "192", "train.seq_len": "192",
             "train.micro_batch": "4", "train.global_batch": "4", "compute.precision": "fp32",
             "compute.device": "cpu"}
"""The reference step's model and batch (head size 48, 768 tokens a micro-batch; chosen apart from the
validation model of bench/planner_cpu.py)."""

PLACEHOLDERS = {"dtensor_op": 0.0, "fsdp_hook": 0.0, "step_factor_1": 1.0, "step_factor_n": 1.0,
                "tp_linear": 0.0, "fsdp_unit": 0.0,
                "comm_factor": 1.0}


def reference_config(**overrides: str) -> Config:
    """The reference step's config with `overrides` (dotted keys)."""
    return build_config({}, {**REFERENCE, **overrides})


def _fastest(fn, repeats: int, clock) -> float:
    fn()  # warm-up: AdamW's state, the allocator's pages
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def _timed_step(cfg: Config, world_size: int, threads: int, repeats: int) -> float:
    """Seconds of one real micro-batch + clip + AdamW step of rank 0 (inside a fake group when world_size > 1)."""
    model, dp, mesh = parallel_model(cfg, world_size, None)
    micro_batch, optimizer_step = step_function(cfg, model, dp, mesh, None)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        clock = time.thread_time if threads == 1 else time.perf_counter
        return _fastest(lambda: (micro_batch(), optimizer_step()), repeats, clock)
    finally:
        torch.set_num_threads(saved)


def _price(ops: tuple[Op, ...], costs: CpuCosts, threads: int) -> float:
    return sum(ops_seconds(ops, costs, threads).values())


def reference_table(table: dict, repeats: int = 5) -> dict:
    """step_factor_1, step_factor_n, dtensor_op and fsdp_hook for the [cpu] `table` measured so far (its rate
    tables and op costs)."""
    costs = CpuCosts(**{**PLACEHOLDERS, **{k: v for k, v in table.items()}})
    costs = dataclasses.replace(costs, step_factor_1=1.0, step_factor_n=1.0, dtensor_op=0.0)
    cores = costs.cores
    torch.set_flush_denormal(True)  # a fake group's gathered buffers hold whatever the memory held
    try:
        one = reference_config()
        ops = sum(trace_in_group(one, 1), ())  # one process: no group needed
        single = _timed_step(one, 1, 1, repeats)
        out = {"step_factor_1": single / _price(ops, costs, 1)}
        # Every core is never slower than one (torch could run each op on one): a slower figure was disturbed.
        every = min(single, _timed_step(one, 1, cores, repeats)) if cores > 1 else single
        out["step_factor_n"] = every / _price(ops, costs, cores)
        costs = dataclasses.replace(costs, step_factor_1=out["step_factor_1"])
        tp = reference_config(**{"parallel.tp": "2", "parallel.sequence_parallel": "true"})
        with fake_process_group(2):
            ops = sum(trace_in_group(tp, 2), ())
            spent = _timed_step(tp, 2, 1, repeats)
        count = sum(op.dtensor for op in ops)
        out["dtensor_op"] = max(1e-7, (spent - _price(ops, costs, 1)) / max(1, count))
        costs = dataclasses.replace(costs, dtensor_op=out["dtensor_op"])
        fsdp = reference_config(**{"parallel.fsdp": "2", "train.global_batch": "8"})
        with fake_process_group(2):
            ops = sum(trace_in_group(fsdp, 2), ())
            spent = _timed_step(fsdp, 2, 1, repeats)
        out["fsdp_hook"] = max(1e-7, (spent - _price(ops, costs, 1)) / (fsdp.model.n_layers + 1))
    finally:
        torch.set_flush_denormal(False)
    return out

