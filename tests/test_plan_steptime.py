"""The step-time model: its pipeline bubble is the schedules' own, its links follow the mesh order, and each
cost moves the way it must (more recompute, slower links, more pipeline stages over few micro-batches)."""

from __future__ import annotations

import dataclasses

import pytest

from fourfold.config import build_config
from fourfold.plan.hardware import load_hardware
from fourfold.plan.steptime import Cluster, predict_step, schedule_length


def _cfg(**over):
    flat = {"model.preset": "llama3-8b", "train.seq_len": "4096", "train.global_batch": "64",
            "train.micro_batch": "1", "compute.precision": "bf16", "compute.device": "cuda"}
    flat.update({k: str(v) for k, v in over.items()})
    return build_config({}, flat)


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 16)])
def test_one_f_one_b_and_gpipe_lengths_are_the_textbook_formula(pp, m):
    for schedule in ("1f1b", "gpipe"):
        assert schedule_length(schedule, pp, 1, m) == pytest.approx(3 * (m + pp - 1))
    # two chunks per rank: units are half as long, the bubble (beyond the 2 * 3m units of work) is smaller
    interleaved = schedule_length("interleaved-1f1b", pp, 2, m)
    assert 2 * 3 * m <= interleaved and interleaved / (2 * 3 * m) < (m + pp - 1) / m


def test_links_follow_the_mesh_order():
    hw = load_hardware(calibration=False)
    c = Cluster.build(hw, "h100", 8, "ib400")
    sizes = {"pp": 2, "dp": 4, "fsdp": 1, "cp": 1, "tp": 8}
    assert c.group_link(sizes, "tp").name == "nvlink4"
    assert c.group_link(sizes, "dp").name == "ib400" and c.group_link(sizes, "pp").name == "ib400"
    sizes = {"pp": 1, "dp": 1, "fsdp": 2, "cp": 1, "tp": 4}
    assert c.group_link(sizes, "fsdp").name == "nvlink4"


def test_each_cost_moves_the_right_way():
    hw = load_hardware(calibration=False)
    node = Cluster.build(hw, "h100", 8, "ib400")
    slow = Cluster.build(hw, "h100", 8, "eth25")
    base = _cfg(**{"parallel.fsdp": 16, "parallel.param_dtype": "bf16", "compute.compile": "true"})
    t = predict_step(base, 16, node).seconds
    assert predict_step(_cfg(**{"parallel.fsdp": 16, "parallel.param_dtype": "bf16", "compute.compile": "true",
                                "compute.recompute": "full"}), 16, node).seconds > t
    assert predict_step(base, 16, slow).seconds > t
    assert predict_step(base, 16, Cluster.build(hw, "h200", 8, "ib400")).seconds < t
    few = _cfg(**{"parallel.pp": 4, "train.global_batch": "4"})
    many = _cfg(**{"parallel.pp": 4, "train.global_batch": "32"})
    s_few, s_many = predict_step(few, 4, node), predict_step(many, 4, node)
    assert s_few.parts["bubble"] / s_few.seconds > s_many.parts["bubble"] / s_many.seconds
    f8 = dataclasses.replace(base, quant=dataclasses.replace(base.quant, float8=True))
    assert predict_step(f8, 16, node).parts["matmul"] < predict_step(base, 16, node).parts["matmul"]


def test_tokens_and_mfu_use_the_trainers_flops():
    from fourfold.models.llama import training_flops_per_token

    hw = load_hardware(calibration=False)
    cfg = _cfg()
    step = predict_step(cfg, 1, Cluster.build(hw, "h200", 1, "ib400"))
    assert step.tokens == 64 * 4096
    assert step.model_flops == pytest.approx(step.tokens * training_flops_per_token(cfg.model, 4096))
    assert 0 < step.mfu(1, 989e12) < 1
