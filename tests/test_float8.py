"""quant.float8: which linears torchao converts, that training with them tracks bf16, and the errors for bad set-ups."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fourfold.config import build_config
from fourfold.errors import ConfigError, LayoutError
from fourfold.layout import validate_layout
from fourfold.mesh import ParallelMesh
from fourfold.models.llama import Llama
from fourfold.parallel.apply import apply_model_transforms
from fourfold.train.trainer import train
from tests.trainer_helpers import grad_norms, losses, tiny_config, train_on_rank

torchao = pytest.importorskip("torchao")  # the test extra installs it; the float8 extra is optional for users


def test_block_linears_become_float8_and_the_head_and_names_stay(tmp_path):
    from torchao.float8.float8_linear import Float8Linear

    cfg = tiny_config(tmp_path, **{"compute.precision": "bf16", "quant.float8": True})
    model = Llama(cfg.model)
    names = [n for n, _ in model.named_parameters()]
    model = apply_model_transforms(model, ParallelMesh.build(cfg), cfg.parallel, cfg.compute, cfg.quant,
                                   torch.device("cpu"))
    linears = {n: type(m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears.pop("output") is torch.nn.Linear
    assert len(linears) == 7 * cfg.model.n_layers and set(linears.values()) == {Float8Linear}
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints move between float8 and bf16 runs


def test_float8_training_tracks_bf16_but_is_not_bf16(tmp_path):
    runs = {}
    for float8 in (False, True):
        cfg = tiny_config(tmp_path, **{"compute.precision": "bf16", "quant.float8": float8, "train.steps": 12})
        train(cfg, tmp_path / f"run-{float8}")
        runs[float8] = losses(tmp_path / f"run-{float8}")
    bf16, f8 = runs[False], runs[True]
    assert f8[-1] < f8[0] - 0.5  # it learns
    assert all(abs(a - b) < 0.05 * a for a, b in zip(bf16, f8))  # close to bf16 at every step...
    assert any(a != b for a, b in zip(bf16, f8))  # ...but the matmuls really ran in float8


def test_float8_needs_bf16_precision():
    with pytest.raises(ConfigError, match="--compute.precision bf16"):
        build_config({}, {"quant.float8": "true", "compute.precision": "fp32"})


def test_float8_with_tensor_parallel_is_refused_before_any_process_group(tmp_path):
    cfg = tiny_config(tmp_path, **{"compute.precision": "bf16", "quant.float8": True, "parallel.tp": 2})
    with pytest.raises(LayoutError, match="--parallel.tp 1"):
        validate_layout(cfg, 2)


def test_missing_torchao_is_a_clear_error(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    cfg = tiny_config(tmp_path, **{"compute.precision": "bf16", "quant.float8": True})
    with pytest.raises(ConfigError, match=r"fourfold\[float8\]"):
        validate_layout(cfg, 1)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"parallel.dp": 2}, {"parallel.fsdp": 2}], ids=["ddp2", "fsdp2"])
def test_float8_under_data_parallel_matches_one_process(tmp_path, layout):
    """DDP and FSDP2 (weights all-gathered before the float8 cast) train like one float8 process."""
    from tests.distributed.launcher import run_ranks

    float8 = {"compute.precision": "bf16", "quant.float8": True, "train.steps": 5}
    train(tiny_config(tmp_path, **float8), tmp_path / "single")
    run_ranks(train_on_rank, 2, args=(str(tmp_path), {**float8, **layout}, "parallel"))
    single, parallel = tmp_path / "single", tmp_path / "parallel"
    # Only the gradient summation order differs (measured: losses equal, gradient norms within 5e-7).
    assert losses(parallel) == pytest.approx(losses(single), rel=1e-5)
    assert grad_norms(parallel) == pytest.approx(grad_norms(single), rel=1e-4)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_with_float8_gives_the_same_training(tmp_path, mode):
    """Recomputed float8 matmuls recompute their scales from the same inputs: the same losses as without."""
    runs = {}
    for recompute in ("none", mode):
        cfg = tiny_config(tmp_path, **{"compute.precision": "bf16", "quant.float8": True, "train.steps": 4,
                                       "compute.recompute": recompute})
        train(cfg, tmp_path / recompute)
        runs[recompute] = (losses(tmp_path / recompute), grad_norms(tmp_path / recompute))
    assert runs[mode][0] == pytest.approx(runs["none"][0], rel=1e-6)
    assert runs[mode][1] == pytest.approx(runs["none"][1], rel=1e-5)
