"""Every parallel layout reproduces single-process training through the real trainer (gloo, float64).

One table of layouts, one test: each layout trains the same tiny config (fixed global batch, same seed
and data) for 5 optimizer steps on N gloo ranks; its per-step losses and its final weights (from the
final checkpoint, gathered to full tensors by name) must equal the single-process run's.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launcher import run_ranks
from tests.trainer_helpers import final_weights, grad_norms, losses, tiny_config, train_on_rank

STEPS = 5
# name -> (ranks, overrides). The base config: 4 layers, 4 heads, 2 kv heads, global batch 8, micro 2.
LAYOUTS = {
    "dp2": (2, {"parallel.dp": 2}),
    "fsdp2": (2, {"parallel.fsdp": 2}),
    "zero1-2": (2, {"parallel.fsdp": 2, "parallel.zero": 1}),
    "zero2-2": (2, {"parallel.fsdp": 2, "parallel.zero": 2}),
    "hsdp-2x2": (4, {"parallel.dp": 2, "parallel.fsdp": 2}),
    "ddp4-hierarchical-2x2": (4, {"parallel.dp": 4, "parallel.hierarchical_allreduce": True,
                                  "parallel.gpus_per_node": 2}),
    "fsdp2-reshard-off": (2, {"parallel.fsdp": 2, "parallel.reshard_after_forward": False}),
    "fsdp4": (4, {"parallel.fsdp": 4}),
    "ddp4": (4, {"parallel.dp": 4}),
    "zero1-4": (4, {"parallel.fsdp": 4, "parallel.zero": 1}),
    "zero2-4": (4, {"parallel.fsdp": 4, "parallel.zero": 2}),
    "tp2": (2, {"parallel.tp": 2, "parallel.sequence_parallel": False}),
    "tp2-sp": (2, {"parallel.tp": 2}),
    "cp2": (2, {"parallel.cp": 2}),
    "tp2-fsdp2": (4, {"parallel.tp": 2, "parallel.fsdp": 2}),
    "cp2-fsdp2": (4, {"parallel.cp": 2, "parallel.fsdp": 2}),
    "cp2-tp2": (4, {"parallel.cp": 2, "parallel.tp": 2}),
    "pp2-1f1b": (2, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
    "pp2-gpipe": (2, {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"}),
    "pp2-zb": (2, {"parallel.pp": 2, "parallel.pp_schedule": "zero-bubble"}),
    "pp2-vpp2": (2, {"parallel.pp": 2, "parallel.vpp": 2, "parallel.pp_schedule": "interleaved-1f1b"}),
    "pp2-fsdp2": (4, {"parallel.pp": 2, "parallel.fsdp": 2}),
    "tp4-kv-split": (4, {"parallel.tp": 4, "model.n_kv_heads": 4}),
    "cp4": (4, {"parallel.cp": 4}),
    "cp2-allgather": (2, {"parallel.cp": 2, "parallel.cp_method": "allgather"}),
    "pp4-1f1b": (4, {"parallel.pp": 4}),
    "pp4-zb": (4, {"parallel.pp": 4, "parallel.pp_schedule": "zero-bubble"}),
    "4d-pp2-fsdp2-tp2": (8, {"parallel.pp": 2, "parallel.fsdp": 2, "parallel.tp": 2}),
    "pp2-cp2-tp2": (8, {"parallel.pp": 2, "parallel.cp": 2, "parallel.tp": 2}),
}
FAST = {"dp2", "fsdp2", "tp2-sp", "cp2", "pp2-1f1b"}


MODEL_KEYS = ("model.",)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Single-process runs, one per model shape used in the table (most layouts share the default)."""
    from fourfold.train.trainer import train

    tmp = tmp_path_factory.mktemp("layouts")
    cache = {}

    def get(overrides: dict):
        model = {k: v for k, v in overrides.items() if k.startswith(MODEL_KEYS)}
        key = tuple(sorted(model.items()))
        if key not in cache:
            run = tmp / f"single-{len(cache)}"
            train(tiny_config(tmp, **{"compute.precision": "fp64", "train.steps": STEPS, **model}), run)
            cache[key] = (losses(run), grad_norms(run), final_weights(run))
        return tmp, *cache[key]

    return get


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in LAYOUTS])
def test_layout_matches_single_process(name, references):
    ranks, overrides = LAYOUTS[name]
    tmp, ref_losses, ref_norms, ref_weights = references(overrides)
    run_ranks(train_on_rank, ranks, args=(str(tmp), {"compute.precision": "fp64", "train.steps": STEPS, **overrides}, name))
    got_losses = losses(tmp / name)
    assert len(got_losses) == STEPS
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(ref_losses), rtol=1e-9, atol=1e-12)
    # The gradient norm exposes a wrong reduction (a sum not divided, a missing all-reduce) that AdamW's
    # scale invariance and clipping would hide from the weights.
    torch.testing.assert_close(torch.tensor(grad_norms(tmp / name)), torch.tensor(ref_norms), rtol=1e-9, atol=1e-12)
    weights = final_weights(tmp / name)
    assert weights.keys() == ref_weights.keys()
    for key, ref in ref_weights.items():
        torch.testing.assert_close(weights[key], ref, rtol=1e-8, atol=1e-10, msg=lambda m: f"{key}: {m}")
