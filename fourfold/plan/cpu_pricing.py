"""Prices a traced op list: each op at the [cpu] table's cost for its class and size, times the step factor.

    seconds = ops_seconds(ops, costs, threads=1)      # {'matmul': ..., 'attention': ..., 'elementwise': ...,
                                                      #  'views': ..., 'dtensor': ...}
    comm = collectives_seconds(ops, costs)            # the traced collectives at gloo's alpha-beta

Shared by the one-process and pipeline model (fourfold/plan/cpu_steptime.py), the traced parallel layouts
(fourfold/plan/cpu_traced_step.py) and the reference-step calibration (fourfold/plan/calibrate_reference.py).
"""

from __future__ import annotations

from fourfold.plan.cpu_costs import CpuCosts
from fourfold.plan.cpu_trace import Op


def ops_seconds(ops: tuple[Op, ...], costs: CpuCosts, threads: int, matmul_speedup: float = 1.0) -> dict[str, float]:
    """Seconds of `ops` by class: matmul, attention, elementwise (foreach included), views, each at the tables'
    price times the calibrated step factor; dtensor (what DTensor's dispatch adds). Collectives are priced apart."""
    out = {"matmul": 0.0, "attention": 0.0, "elementwise": 0.0, "views": 0.0, "dtensor": 0.0}
    factor = costs.step_factor(threads)
    for op in ops:
        if op.dtensor:
            out["dtensor"] += costs.dtensor_op
        if op.kind == "matmul":
            out["matmul"] += factor * costs.matmul_seconds(op.flops, threads) / matmul_speedup
        elif op.kind == "attention":
            out["attention"] += factor * costs.attention_seconds(op.flops, op.backward, threads)
        elif op.kind == "foreach":
            out["elementwise"] += factor * (costs.elementwise_seconds(op.nbytes, threads, op.tensors) +
                                            op.tensors * costs.foreach_tensor)
        elif op.kind == "view":
            out["views"] += factor * costs.view_overhead
        elif op.kind != "collective":
            out["elementwise"] += factor * costs.elementwise_seconds(op.nbytes, threads)
    return out


def collectives_seconds(ops: tuple[Op, ...], costs: CpuCosts) -> float:
    """gloo seconds of the traced collectives of `ops` (each over the ranks of its group)."""
    return sum(costs.collective_seconds(op.name, op.nbytes, op.tensors) for op in ops if op.kind == "collective")
