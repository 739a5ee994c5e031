"""Parameter, gradient and optimizer bytes of the memory model equal the counted tensors of the model, for
several presets (built on the meta device) and every data-parallel strategy, summed over the ranks."""

from __future__ import annotations

import pytest

from fourfold.config import build_config
from fourfold.models.llama import parameter_counts
from fourfold.plan.layout import meta_model
from fourfold.plan.memory import estimate_memory
from fourfold.plan.search import state_bytes


def _cfg(preset, **over):
    flat = {"model.preset": preset, "train.seq_len": "128", "train.global_batch": "8", "train.micro_batch": "1",
            "compute.precision": "bf16", "compute.device": "cuda"}
    flat.update({k: str(v) for k, v in over.items()})
    return build_config({}, flat)


@pytest.mark.parametrize("preset", ["tiny", "llama-1b", "llama3-8b", "llama3-70b"])
def test_single_rank_bytes_are_the_counted_parameters(preset):
    cfg = _cfg(preset)
    counted = sum(p.numel() for p in meta_model(cfg.model).parameters())
    assert counted == parameter_counts(cfg.model)[0]
    est = estimate_memory(cfg, 1)
    assert est.params == est.grads == 4 * counted and est.optimizer == 8 * counted
    assert state_bytes(cfg) == pytest.approx(16 * counted)


@pytest.mark.parametrize("preset", ["tiny", "llama-1b", "llama3-8b"])
@pytest.mark.parametrize("layout, world", [({"parallel.dp": 4}, 4), ({"parallel.fsdp": 4}, 4),
                                           ({"parallel.fsdp": 4, "parallel.zero": 1}, 4),
                                           ({"parallel.tp": 2, "parallel.fsdp": 2}, 4),
                                           ({"parallel.pp": 2, "parallel.fsdp": 2}, 4)])
def test_bytes_summed_over_ranks_are_the_counted_parameters(preset, layout, world):
    cfg = _cfg(preset, **layout)
    counted = sum(p.numel() for p in meta_model(cfg.model).parameters())
    per_rank = [estimate_memory(cfg, world, r) for r in range(world)]
    p = cfg.parallel
    replicas = p.dp if p.fsdp == 1 and p.tp == 1 else 1
    norms = 0 if p.tp == 1 else (2 * cfg.model.n_layers + 1) * cfg.model.dim  # replicated over tp
    optimizer = sum(e.optimizer for e in per_rank)
    assert optimizer == 8 * (counted * replicas + norms * (p.tp - 1))
    grads = sum(e.grads - e.param_padding for e in per_rank)
    if p.zero == 1:
        assert grads == 4 * counted * p.fsdp  # ZeRO-1 keeps full gradients on every rank
    else:
        assert grads == 4 * (counted * replicas + norms * (p.tp - 1))
