"""The layout parity table: every parallel layout that must train exactly like one process, as data.

    for name, layout in LAYOUTS.items():   # layout.ranks processes, config overrides layout.overrides
        ...train the same config with PARITY_OVERRIDES and layout.overrides, compare with one process

The gloo parity test (tests/distributed/test_layouts.py) runs every row; the NCCL check
(bench/nccl_parity.py) runs the rows that fit its GPUs. Both train in float64 for PARITY_STEPS optimizer
steps with a fixed global batch, so per-step losses, gradient norms and final weights must equal the
single-process run of the same config (and the same model overrides) within PARITY_TOLERANCE.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PARITY_STEPS = 5
PARITY_OVERRIDES = {"compute.precision": "fp64", "train.steps": PARITY_STEPS}
# (rtol, atol) per compared quantity, for float64 runs.
PARITY_TOLERANCE = {"loss": (1e-9, 1e-12), "grad_norm": (1e-9, 1e-12), "weight": (1e-8, 1e-10)}


@dataclass(frozen=True)
class ParityLayout:
    """One row: how many ranks, the config overrides that make the layout, and whether it is in the fast set."""

    ranks: int
    overrides: dict = field(default_factory=dict)
    fast: bool = False

    def cli_args(self) -> list[str]:
        """The overrides as `fourfold train` flags: ['--parallel.dp', '2', ...]."""
        return [arg for key, value in self.overrides.items() for arg in (f"--{key}", _cli_value(value))]


def _cli_value(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def model_overrides(overrides: dict) -> dict:
    """The model.* part of `overrides`: layouts sharing it compare with the same single-process run."""
    return {k: v for k, v in overrides.items() if k.startswith("model.")}


# `fast` rows take about a second each on 2 CPU cores and run in the default test selection; they hold every
# dimension at least once, and pp4 (the smallest pipeline whose two neighbours differ). The others (DTensor
# on 4 or 8 ranks, FSDP on 4) take several seconds and are marked slow.
# Base config (fourfold.testing.runs.tiny_config): 4 layers, 4 heads, 2 kv heads, global batch 8, micro 2.
LAYOUTS: dict[str, ParityLayout] = {
    "dp2": ParityLayout(2, {"parallel.dp": 2}, fast=True),
    "fsdp2": ParityLayout(2, {"parallel.fsdp": 2}, fast=True),
    "zero1-2": ParityLayout(2, {"parallel.fsdp": 2, "parallel.zero": 1}, fast=True),
    "zero2-2": ParityLayout(2, {"parallel.fsdp": 2, "parallel.zero": 2}, fast=True),
    "hsdp-2x2": ParityLayout(4, {"parallel.dp": 2, "parallel.fsdp": 2}),
    "ddp4-hierarchical-2x2": ParityLayout(4, {"parallel.dp": 4, "parallel.hierarchical_allreduce": True,
                                              "parallel.gpus_per_node": 2}, fast=True),
    "fsdp2-reshard-off": ParityLayout(2, {"parallel.fsdp": 2, "parallel.reshard_after_forward": False}, fast=True),
    "fsdp4": ParityLayout(4, {"parallel.fsdp": 4}),
    "ddp4": ParityLayout(4, {"parallel.dp": 4}, fast=True),
    "zero1-4": ParityLayout(4, {"parallel.fsdp": 4, "parallel.zero": 1}, fast=True),
    "zero2-4": ParityLayout(4, {"parallel.fsdp": 4, "parallel.zero": 2}),
    "tp2": ParityLayout(2, {"parallel.tp": 2, "parallel.sequence_parallel": False}),
    "tp2-sp": ParityLayout(2, {"parallel.tp": 2}, fast=True),
    "cp2": ParityLayout(2, {"parallel.cp": 2}, fast=True),
    "tp2-fsdp2": ParityLayout(4, {"parallel.tp": 2, "parallel.fsdp": 2}),
    "cp2-fsdp2": ParityLayout(4, {"parallel.cp": 2, "parallel.fsdp": 2}),
    "cp2-tp2": ParityLayout(4, {"parallel.cp": 2, "parallel.tp": 2}),
    "pp2-1f1b": ParityLayout(2, {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"}, fast=True),
    "pp2-gpipe": ParityLayout(2, {"parallel.pp": 2, "parallel.pp_schedule": "gpipe"}, fast=True),
    "pp2-zb": ParityLayout(2, {"parallel.pp": 2, "parallel.pp_schedule": "zero-bubble"}, fast=True),
    "pp2-vpp2": ParityLayout(2, {"parallel.pp": 2, "parallel.vpp": 2, "parallel.pp_schedule": "interleaved-1f1b"},
                             fast=True),
    "pp2-fsdp2": ParityLayout(4, {"parallel.pp": 2, "parallel.fsdp": 2}),
    "tp4-kv-split": ParityLayout(4, {"parallel.tp": 4, "model.n_kv_heads": 4}),
    "cp4": ParityLayout(4, {"parallel.cp": 4}),
    "cp2-allgather": ParityLayout(2, {"parallel.cp": 2, "parallel.cp_method": "allgather"}, fast=True),
    "pp4-1f1b": ParityLayout(4, {"parallel.pp": 4}, fast=True),
    "pp4-zb": ParityLayout(4, {"parallel.pp": 4, "parallel.pp_schedule": "zero-bubble"}, fast=True),
    "4d-pp2-fsdp2-tp2": ParityLayout(8, {"parallel.pp": 2, "parallel.fsdp": 2, "parallel.tp": 2}),
    "pp2-cp2-tp2": ParityLayout(8, {"parallel.pp": 2, "parallel.cp": 2, "parallel.tp": 2}),
}
