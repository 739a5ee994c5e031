"""What `apply_model_transforms` compiles on one process: each block (compute.compile_scope blocks) or the whole forward (model)."""

from __future__ import annotations

import pytest
import torch

from fourfold.mesh import ParallelMesh
from fourfold.models.llama import Llama
from fourfold.parallel.apply import apply_model_transforms
from tests.trainer_helpers import tiny_config


def _compiled(module: torch.nn.Module) -> bool:
    """True once `module.compile()` has replaced its call (compilation itself waits for the first call)."""
    return getattr(module, "_compiled_call_impl", None) is not None


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compile_scope_chooses_what_is_compiled(scope, tmp_path):
    cfg = tiny_config(tmp_path, **{"compute.compile": True, "compute.compile_scope": scope})
    model = Llama(cfg.model)
    names = [n for n, _ in model.named_parameters()]
    model = apply_model_transforms(model, ParallelMesh.build(cfg), cfg.parallel, cfg.compute, cfg.quant,
                                   torch.device("cpu"))
    assert _compiled(model) == (scope == "model")
    assert all(_compiled(block) == (scope == "blocks") for block in model.layers.values())
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints keep their keys either way
