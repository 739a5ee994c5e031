"""Inference planning: KV bytes from the shape, capacity grows with the GPUs, decode is bounded by bandwidth."""

from __future__ import annotations

from fourfold.config import build_config
from fourfold.models.llama import parameter_counts
from fourfold.plan.hardware import load_hardware
from fourfold.plan.inference import kv_bytes_per_token, plan_inference


def test_kv_bytes_capacity_and_decode_bounds():
    model = build_config({}, {"model.preset": "llama3-70b"}).model
    assert kv_bytes_per_token(model) == 2 * 80 * 8 * 128 * 2
    hw = load_hardware(calibration=False)
    dev = hw.device("h100")
    rows = {(r.tp, r.pp): r for r in plan_inference(model, dev, hw.efficiency, hw.link("nvlink4"), 8192, 8)}
    assert rows[(1, 1)].max_sequences == 0  # 140 GB of bf16 weights on one 80 GB GPU
    assert rows[(8, 1)].max_sequences > rows[(4, 1)].max_sequences > rows[(2, 1)].max_sequences > 0
    total, _ = parameter_counts(model)
    for (tp, pp), r in rows.items():
        assert r.weight_bytes == total * 2 / (tp * pp)
        if r.max_sequences:
            # a batch-1 token must at least read every weight once over all the GPUs' bandwidth
            assert r.tokens_per_s_batch1 <= tp * dev.hbm_bandwidth / (total * 2)
            assert r.tokens_per_s_max > r.tokens_per_s_batch1
    int4 = plan_inference(model, dev, hw.efficiency, hw.link("nvlink4"), 8192, 8, weight_dtype="int4")
    assert next(r for r in int4 if (r.tp, r.pp) == (1, 1)).max_sequences > 0
