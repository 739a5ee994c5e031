"""Every parallel layout reproduces single-process training through the real trainer (gloo, float64).

One table of layouts (fourfold.testing.LAYOUTS, shared with bench/nccl_parity.py), one test: each layout
trains the same tiny config (fixed global batch, same seed and data) for PARITY_STEPS optimizer steps on N
gloo ranks; its per-step losses, gradient norms and final weights (from the final checkpoint, gathered
to full tensors by name) must equal the single-process run's.
"""

from __future__ import annotations

import pytest

from fourfold.testing import LAYOUTS, PARITY_OVERRIDES, model_overrides
from fourfold.train.trainer import train
from tests.distributed.launcher import run_ranks
from tests.trainer_helpers import assert_matches_reference, run_results, tiny_config, train_on_rank


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Single-process runs, one per model shape used in the table (most layouts share the default)."""
    tmp = tmp_path_factory.mktemp("layouts")
    cache = {}

    def get(overrides: dict):
        model = model_overrides(overrides)
        key = tuple(sorted(model.items()))
        if key not in cache:
            run = tmp / f"single-{len(cache)}"
            train(tiny_config(tmp, **{**PARITY_OVERRIDES, **model}), run)
            cache[key] = run_results(run)
        return tmp, cache[key]

    return get


def test_table_has_a_fast_row_per_dimension():
    """The default (not slow) selection still runs one layout of every parallel dimension."""
    fast = [layout.overrides for layout in LAYOUTS.values() if layout.fast]
    for dim in ("dp", "fsdp", "tp", "cp", "pp"):
        assert any(o.get(f"parallel.{dim}", 1) > 1 for o in fast), dim


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if layout.fast else pytest.mark.slow)
                                  for n, layout in LAYOUTS.items()])
def test_layout_matches_single_process(name, references):
    layout = LAYOUTS[name]
    tmp, ref = references(layout.overrides)
    run_ranks(train_on_rank, layout.ranks, args=(str(tmp), {**PARITY_OVERRIDES, **layout.overrides}, name))
    assert_matches_reference(tmp / name, ref)
