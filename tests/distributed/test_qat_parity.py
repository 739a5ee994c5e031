"""Quantization-aware training (quant.qat) under FSDP, tensor parallel and pipeline parallel reproduces one process.

The real trainer, gloo, float64, the parity tolerances of fourfold.testing: each layout trains the tiny config
with fake-quant block linears for PARITY_STEPS steps and must match the single-process QAT run's losses,
gradient norms and final weights. The model is widened to dim 64 / ffn 128 so that under tp=2 the
row-parallel shards (wo: 32, w2: 64 input features) hold whole groups of 32.
"""

from __future__ import annotations

import pytest

from fourfold.testing import PARITY_OVERRIDES
from fourfold.train.trainer import train
from tests.distributed.launcher import run_ranks
from tests.trainer_helpers import assert_matches_reference, run_results, tiny_config, train_on_rank

QAT = {**PARITY_OVERRIDES, "model.dim": 64, "model.ffn_dim": 128}
LAYOUTS = {
    "fsdp2": (2, {"parallel.fsdp": 2}),
    "tp2-sp": (2, {"parallel.tp": 2}),
    "pp2": (2, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}),
}
SCHEMES = ["int4-g32", "8da4w-g32-fp32"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qat")
    cache = {}

    def get(scheme: str):
        if scheme not in cache:
            run = tmp / f"single-{scheme}"
            train(tiny_config(tmp, **QAT, **{"quant.qat": scheme}), run)
            cache[scheme] = run_results(run)
        return tmp, cache[scheme]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_qat_layout_matches_single_process(layout, scheme, reference):
    tmp, ref = reference(scheme)
    ranks, overrides = LAYOUTS[layout]
    name = f"{layout}-{scheme}"
    run_ranks(train_on_rank, ranks, args=(str(tmp), {**QAT, **overrides, "quant.qat": scheme}, name))
    assert_matches_reference(tmp / name, ref)


def test_qat_really_fake_quantizes(reference):
    """The reference differs from the same run in full precision (the QAT path is not a no-op)."""
    tmp, ref = reference("int4-g32")
    train(tiny_config(tmp, **QAT), tmp / "full-precision")
    assert run_results(tmp / "full-precision")["losses"][1:] != ref["losses"][1:]


def test_group_straddling_a_tp_shard_is_refused(tmp_path):
    """Groups of 64 would straddle the tp=2 shards of wo (32 input features each): ConfigError before training."""
    with pytest.raises(RuntimeError, match="ConfigError.*straddle"):
        run_ranks(train_on_rank, 2, args=(str(tmp_path), {**QAT, "parallel.tp": 2, "quant.qat": "int4-g64"}, "x"))
