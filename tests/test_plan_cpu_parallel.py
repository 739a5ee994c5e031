"""The CPU step model of parallel layouts: the fake-process-group trace against a real gloo step, and its pricing."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import pytest

from fourfold.plan.cpu_parallel_trace import needs_parallel_trace, parallel_step_ops
from fourfold.plan.cpu_steptime import predict_cpu_step
from fourfold.plan.cpu_trace import OpRecorder
from fourfold.plan.hardware import load_hardware
from fourfold.testing import tiny_config
from tests.distributed.launcher import run_ranks

LAYOUTS = {"tp2-sp": {"parallel.tp": 2, "parallel.sequence_parallel": True, "train.global_batch": 2},
           "cp2": {"parallel.cp": 2, "train.global_batch": 2},
           "fsdp2": {"parallel.fsdp": 2, "train.global_batch": 4}}
SHAPE = {"train.micro_batch": 2, "compute.precision": "fp32"}


def _summary(ops) -> dict:
    """What must agree between the trace and a real step: GEMM FLOPs, DTensor ops by name, collectives by kind and
    size, attention calls, foreach ops."""
    return {"matmul": sorted(o.flops for o in ops if o.kind == "matmul"),
            "dtensor": collections.Counter(o.name for o in ops if o.dtensor and o.kind != "view"),
            "collectives": collections.Counter((o.name, o.nbytes) for o in ops if o.kind == "collective"),
            "attention": sorted(o.flops for o in ops if o.kind == "attention"),
            "foreach": collections.Counter(o.name for o in ops if o.kind == "foreach")}


def _real_step(rank: int, world: int, tmp: str, name: str) -> dict:
    """On each gloo rank: a trainer of layout `name` takes one step, then one recorded step; rank 0's summary."""
    from fourfold.train.trainer import Trainer

    cfg = tiny_config(Path(tmp), **SHAPE, **LAYOUTS[name])
    trainer = Trainer(cfg, Path(tmp) / f"run-{name}")
    trainer.train_step()
    recorder = OpRecorder()
    with recorder:
        trainer.train_step()
    return {**_summary(recorder.ops), "count": len(recorder.ops)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_parallel_trace_equals_a_real_gloo_step(tmp_path, name):
    """Rank 0's traced step (its parallelised model over the fake process group, fake tensors) issues the same
    GEMMs, the same DTensor ops, the same collectives with the same sizes, the same attention and foreach calls as a
    real trainer step on two gloo ranks; the real step adds only bookkeeping (the loss accumulation, the guard)."""
    cfg = tiny_config(tmp_path, **SHAPE, **LAYOUTS[name])
    assert needs_parallel_trace(cfg)
    micro, optim = parallel_step_ops(cfg, 2)
    model = _summary(micro + optim)
    real = run_ranks(_real_step, 2, args=(str(tmp_path), name))[0]
    assert model["matmul"] == real["matmul"] and model["matmul"]
    assert model["attention"] == real["attention"]
    clip = ("_foreach_norm", "_foreach_mul_")  # the clip's groups follow mesh identity, which may split one more
    adamw = lambda counts: {k: v for k, v in counts.items() if k not in clip}  # noqa: E731
    assert adamw(model["foreach"]) == adamw(real["foreach"]) and adamw(model["foreach"])
    assert all(0 <= model["foreach"][k] - real["foreach"][k] <= 1 and real["foreach"][k] for k in clip)
    # A second trace in one process may meet a mesh object cached by the first (equal, not identical), and the clip
    # groups gradients by mesh identity: it may then issue one group more of its norm and scaling ops.
    clip_ops = collections.Counter({"_foreach_norm": 1, "_foreach_mul_": 1, "stack": 1, "linalg_vector_norm": 1})
    assert not model["dtensor"] - real["dtensor"] - clip_ops, "DTensor ops the model counts that the step lacks"
    assert sum((real["dtensor"] - model["dtensor"]).values()) <= 3  # the loss divisor's division and cast
    missing = model["collectives"] - real["collectives"]
    assert not missing, f"collectives the model counts that the step does not issue: {missing}"
    extra = real["collectives"] - model["collectives"]
    assert extra <= collections.Counter({("all_reduce", 8.0): 2}), f"collectives the model misses: {extra}"
    assert len(micro) + len(optim) >= 0.9 * real["count"]
    if name == "tp2-sp":
        assert sum(model["dtensor"].values()) > 100  # most of a block runs as DTensor ops


def test_trace_is_deterministic_and_layout_specific(tmp_path):
    """Tracing twice gives the same ops; tensor parallel is mostly DTensor ops and context parallel's ring runs
    block matmuls instead of the fused attention kernel; the prediction is a pure function of the config."""
    tp = tiny_config(tmp_path, **SHAPE, **LAYOUTS["tp2-sp"])
    from fourfold.plan import cpu_parallel_trace

    first = parallel_step_ops(tp, 2)
    cpu_parallel_trace._TRACES.clear()
    assert parallel_step_ops(tp, 2) == first
    assert sum(o.dtensor for o in first[0]) > len(first[0]) / 3
    cp = parallel_step_ops(tiny_config(tmp_path, **SHAPE, **LAYOUTS["cp2"]), 2)[0]
    assert not any(o.kind == "attention" for o in cp)
    assert any(o.kind == "collective" and o.name == "p2p" for o in cp)
    hw = load_hardware(calibration=False)
    assert predict_cpu_step(tp, 2, hw.cpu).seconds == predict_cpu_step(tp, 2, hw.cpu).seconds


def test_new_costs_move_only_their_layouts(tmp_path):
    """dtensor_op slows tensor parallel only; fsdp_hook FSDP only; comm_factor every multi-rank layout and not one
    process; the step factors every layout (step_factor_n only the one-process step on every core)."""
    costs = load_hardware(calibration=False).cpu
    cfgs = {name: (tiny_config(tmp_path, **SHAPE, **o), 2) for name, o in LAYOUTS.items()}
    cfgs["1"] = (tiny_config(tmp_path, **SHAPE, **{"train.global_batch": 2}), 1)
    cfgs["dp2"] = (tiny_config(tmp_path, **SHAPE, **{"parallel.dp": 2, "train.global_batch": 4}), 2)
    base = {name: predict_cpu_step(cfg, world, costs).seconds for name, (cfg, world) in cfgs.items()}

    def moved(**change) -> set[str]:
        changed = dataclasses.replace(costs, **change)
        return {name for name, (cfg, world) in cfgs.items()
                if predict_cpu_step(cfg, world, changed).seconds > base[name] * (1 + 1e-9)}

    assert moved(dtensor_op=costs.dtensor_op * 10) >= {"tp2-sp"}
    assert "1" not in moved(dtensor_op=costs.dtensor_op * 10) and "dp2" not in moved(dtensor_op=costs.dtensor_op * 10)
    assert moved(fsdp_hook=costs.fsdp_hook * 10) == {"fsdp2", "cp2"}  # context parallel shards with FSDP2
    assert moved(comm_factor=costs.comm_factor * 2) == {"tp2-sp", "cp2", "fsdp2", "dp2"}
    assert moved(step_factor_1=costs.step_factor_1 * 2) == {"tp2-sp", "cp2", "fsdp2", "dp2"}
    assert moved(step_factor_n=costs.step_factor_n * 2) == {"1"}
