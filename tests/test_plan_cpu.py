"""The CPU step model: its op inventory against a real step, the [cpu] calibration table, and how its terms move."""

from __future__ import annotations

import collections
import dataclasses

import pytest

from fourfold.config import build_config
from fourfold.errors import ConfigError
from fourfold.plan.calibrate import write_calibration
from fourfold.plan.calibrate_cpu import call_overhead, cpu_table_toml, op_overhead
from fourfold.plan.cpu_costs import COLLECTIVES, interpolate
from fourfold.plan.cpu_parallel_trace import fake_process_group
from fourfold.plan.cpu_steptime import predict_cpu_step
from fourfold.plan.cpu_trace import OpRecorder, micro_batch_ops, optimizer_ops
from fourfold.plan.hardware import load_hardware
from fourfold.plan.layout import rank_chunks
from fourfold.plan.predict import predict
from fourfold.testing import tiny_config

SMALL = {"model.dim": "64", "model.n_layers": "2", "model.n_heads": "4", "model.n_kv_heads": "2",
         "model.ffn_dim": "128", "model.vocab_size": "128", "model.max_seq_len": "32", "train.seq_len": "32",
         "train.micro_batch": "2", "train.global_batch": "2", "compute.precision": "fp32", "compute.device": "cpu"}


def _cfg(**overrides):
    return build_config({}, {**SMALL, **{k: str(v) for k, v in overrides.items()}})


def test_traced_ops_equal_a_real_trainer_step(tmp_path):
    """The inventory the model costs (forward, loss, backward, clip, AdamW on fake tensors) is the op list a real
    trainer step issues: the same GEMMs with the same FLOPs, the same attention calls, and every modelled op
    present; the real step adds only a little bookkeeping (loss accumulation, the finite-check)."""
    from fourfold.train.trainer import Trainer

    cfg = tiny_config(tmp_path, **{"train.global_batch": 2, "train.micro_batch": 2, "compute.precision": "fp32"})
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.train_step()  # AdamW's state exists from here on, as in the model's trace
    recorder = OpRecorder()
    with recorder:
        trainer.train_step()
    shapes = tuple(prm.shape for chunk in rank_chunks(cfg, 0) for prm in chunk.params)
    model = list(micro_batch_ops(cfg, cfg.model.n_layers, True, True)) + \
        list(optimizer_ops(shapes, True, cfg.optim.grad_clip > 0))
    real = recorder.ops
    for kind in ("matmul", "attention"):
        assert sorted(o.flops for o in model if o.kind == kind) == sorted(o.flops for o in real if o.kind == kind)
        assert any(o.kind == kind for o in model)
    modelled, issued = collections.Counter(o.name for o in model), collections.Counter(o.name for o in real)
    assert not modelled - issued, f"ops the model counts that the step does not issue: {modelled - issued}"
    assert len(real) - len(model) <= 0.06 * len(real)
    assert sum(o.kind == "foreach" for o in model) == sum(o.kind == "foreach" for o in real)


def test_trace_follows_the_layout():
    """Tensor parallel halves the local GEMM FLOPs of the blocks; a pipeline stage without the head has no loss
    ops; more blocks add ops in proportion; ZeRO-1's per-tensor AdamW issues more ops than foreach."""
    base = micro_batch_ops(_cfg(), 2, True, True)
    tp = micro_batch_ops(_cfg(**{"parallel.tp": 2}), 2, True, True)
    mm = lambda ops: sum(o.flops for o in ops if o.kind == "matmul")  # noqa: E731
    assert mm(tp) == pytest.approx(mm(base) / 2, rel=0.05)
    middle = micro_batch_ops(_cfg(), 1, False, False)
    assert not any("nll_loss" in o.name or "log_softmax" in o.name for o in middle)
    one, two = len(micro_batch_ops(_cfg(), 1, False, False)), len(micro_batch_ops(_cfg(), 2, False, False))
    assert two - one == pytest.approx(one, rel=0.3)
    shapes = ((64, 64), (64,), (128, 64))
    assert len(optimizer_ops(shapes, False, False)) > len(optimizer_ops(shapes, True, False))


def _table(hw) -> dict:
    return {f.name: getattr(hw.cpu, f.name) for f in dataclasses.fields(hw.cpu)}


def test_calibration_file_round_trip(tmp_path):
    """A [cpu] table written by `fourfold plan calibrate` reads back to the same costs, which then drive the CPU
    prediction (doubling every fixed op cost makes a tiny model's step slower)."""
    shipped = load_hardware(calibration=False)
    table = _table(shipped)
    table["op_overhead"] *= 2
    table["view_overhead"] *= 2
    figures = {"name": "cpu", "memory_gib": 8.0, "hbm_bandwidth": 1e10, **{f"flops_{k}": 1e11 for k in
               ("fp64", "fp32", "tf32", "bf16", "fp16")}, "flops_fp8": 0.0, "intra_node": "shm", "link": {},
               "cpu": table}
    path = write_calibration(figures, tmp_path / "calibration.toml")
    hw = load_hardware([path], calibration=False)
    for key, value in table.items():
        got = getattr(hw.cpu, key)
        assert got == pytest.approx(value, rel=1e-5), key
    cfg = _cfg()
    assert predict(cfg, 1, hw, "cpu").step.seconds > predict(cfg, 1, shipped, "cpu").step.seconds


@pytest.mark.parametrize("line, words", [
    ("op_overhead = -1e-6", "op_overhead"),
    ("op_overhead = \"fast\"", "op_overhead"),
    ("matmul_rate_1 = [1e9, 2e9]", "matmul_rate_1"),
    ("matmul_flops = 5", "matmul_flops"),
    ("latency = [1e-5, 1e-5]", "latency"),
    ("bogus = 1", "bogus"),
    ("elementwise_bytes = [10, 5, 20, 30, 40, 50]", "elementwise_bytes"),
    ("comm_factor = 0", "comm_factor"),            # the reference-step and collective factors
    ("dtensor_op = -1e-5", "dtensor_op"),
    ("step_factor_1 = \"slow\"", "step_factor_1"),
    ("fsdp_hook = [1e-3]", "fsdp_hook"),
])
def test_bad_cpu_values_are_clear_errors(tmp_path, line, words):
    """A [cpu] table with a negative, non-numeric, misshaped, unsorted or unknown value is a ConfigError naming it."""
    path = tmp_path / "bad.toml"
    path.write_text(f"[cpu]\n{line}\n")
    with pytest.raises(ConfigError, match=words):
        load_hardware([path], calibration=False)


def test_cpu_toml_lines_parse_back(tmp_path):
    """cpu_table_toml writes every key so that the hardware loader accepts it unchanged."""
    table = _table(load_hardware(calibration=False))
    path = tmp_path / "c.toml"
    path.write_text("\n".join(cpu_table_toml(table)) + "\n")
    assert load_hardware([path], calibration=False).cpu == load_hardware(calibration=False).cpu


def test_layout_terms_move_the_prediction():
    """gloo's latency is charged per collective the layout issues: raising it slows DDP, FSDP and tp but not one
    process; in the fallback estimate raising the DTensor linear cost slows only tp, the FSDP unit cost only FSDP."""
    hw = load_hardware(calibration=False)
    costs = hw.cpu
    slow_comm = dataclasses.replace(costs, latency=tuple(x * 10 for x in costs.latency))
    for overrides, world in (({"parallel.dp": 2, "train.global_batch": 4}, 2),
                             ({"parallel.fsdp": 2, "train.global_batch": 4}, 2), ({"parallel.tp": 2}, 2)):
        cfg = _cfg(**overrides)
        assert predict_cpu_step(cfg, world, slow_comm).seconds > predict_cpu_step(cfg, world, costs).seconds
    one = _cfg()
    assert predict_cpu_step(one, 1, slow_comm).seconds == pytest.approx(predict_cpu_step(one, 1, costs).seconds)
    tp, fsdp = _cfg(**{"parallel.tp": 2}), _cfg(**{"parallel.fsdp": 2, "train.global_batch": 4})
    slow_tp = dataclasses.replace(costs, tp_linear=costs.tp_linear * 10)
    slow_fsdp = dataclasses.replace(costs, fsdp_unit=costs.fsdp_unit * 10)
    # Traced layouts ignore the per-linear and per-unit estimates; inside a process group (a training run) the
    # trace cannot run and the estimate from the layout's rules, which uses them, takes over.
    assert predict_cpu_step(tp, 2, slow_tp).seconds == predict_cpu_step(tp, 2, costs).seconds
    with fake_process_group(2):
        assert predict_cpu_step(tp, 2, slow_tp).seconds > predict_cpu_step(tp, 2, costs).seconds
        assert predict_cpu_step(fsdp, 2, slow_tp).seconds == pytest.approx(predict_cpu_step(fsdp, 2, costs).seconds)
        assert predict_cpu_step(fsdp, 2, slow_fsdp).seconds > predict_cpu_step(fsdp, 2, costs).seconds


def test_interpolation_and_collective_scaling():
    """Rates interpolate log-log between measured sizes and hold outside; a wider ring pays more latency."""
    assert interpolate((1.0, 100.0), (10.0, 1000.0), 10.0) == pytest.approx(100.0)
    assert interpolate((1.0, 100.0), (10.0, 1000.0), 1e6) == 1000.0
    costs = load_hardware(calibration=False).cpu
    for kind in COLLECTIVES[:4]:
        assert costs.collective_seconds(kind, 1e6, 4) > costs.collective_seconds(kind, 1e6, 2) > 0
        assert costs.collective_seconds(kind, 1e6, 1) == 0.0


def test_micro_benchmarks_measure_positive_costs():
    """The per-op micro-benchmarks run and return positive seconds (no timing is asserted beyond that)."""
    assert op_overhead(1) > 0 and call_overhead(1) > 0
