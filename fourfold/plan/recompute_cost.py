"""What activation recomputation buys and costs for a config: activation bytes saved and extra forward FLOPs.

    with_mode = estimate_memory(cfg, world_size)
    without = estimate_memory(without_recompute(cfg), world_size)
    print(recompute_summary(cfg, with_mode, without).line())

The bytes come from the memory model (`fourfold.plan.memory`, exact on CPU and checked against CUDA peaks),
once with the chosen mode and once with none; the caller passes both estimates (the trainer already has
the first one). The cost is the forward work recomputation repeats in
backward, as a fraction of the model FLOPs of a training step (the MFU numerator): full and every-N
recompute re-run the whole forward of their blocks; selective keeps every matmul and attention output
and re-runs element-wise work only, which adds no matmul FLOPs (its cost is memory traffic).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fourfold.config import Config, ModelConfig
from fourfold.models.llama import training_flops_per_token
from fourfold.plan.memory import MemoryEstimate
from fourfold.recompute import recomputed_blocks
from fourfold.units import format_bytes


def block_forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs of one transformer block per token: its matmuls plus attention's two products.

    Attention is counted as in `training_flops_per_token` (4 * dim * seq forward, no causal halving), so
    the blocks' forward FLOPs times 3 plus the head's add up to that function's total.
    """
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    matmul_params = cfg.dim * q + 2 * cfg.dim * kv + q * cfg.dim + 3 * cfg.dim * cfg.ffn_dim
    return 2.0 * matmul_params + 4.0 * cfg.dim * seq_len


@dataclass
class RecomputeSummary:
    """Predicted effect of `mode` on one rank: activations with and without it, and the extra compute."""

    mode: str
    activations: int
    activations_without: int
    extra_flops_fraction: float

    @property
    def saved_bytes(self) -> int:
        """Activation bytes the mode saves on this rank."""
        return self.activations_without - self.activations

    def line(self) -> str:
        """One line for the start of a run."""
        cost = (f"+{self.extra_flops_fraction:.0%} model FLOPs per step (a forward of the recomputed blocks)"
                if self.extra_flops_fraction else "element-wise work only, no extra matmul FLOPs")
        return (f"recompute {self.mode}: activations {format_bytes(self.activations)} instead of "
                f"{format_bytes(self.activations_without)} (saves {format_bytes(self.saved_bytes)}, predicted); "
                f"costs {cost}")


def without_recompute(cfg: Config) -> Config:
    """`cfg` with compute.recompute "none": the baseline the summary compares with."""
    return dataclasses.replace(cfg, compute=dataclasses.replace(cfg.compute, recompute="none"))


def recompute_summary(cfg: Config, with_mode: MemoryEstimate, without: MemoryEstimate) -> RecomputeSummary:
    """The predicted saving and cost of cfg.compute.recompute, from the memory estimates of `cfg` and of
    `without_recompute(cfg)` (same world size and rank)."""
    mode, m, seq = cfg.compute.recompute, cfg.model, cfg.train.seq_len
    repeated = 0.0 if mode == "selective" else len(recomputed_blocks(mode, m.n_layers)) * block_forward_flops_per_token(m, seq)
    return RecomputeSummary(mode, with_mode.activations, without.activations,
                            repeated / training_flops_per_token(m, seq))
