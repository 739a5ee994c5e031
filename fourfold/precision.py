"""Mixed precision: the master dtype, the autocast policy, and dynamic loss scaling for fp16.

- fp32: no autocast. fp64: no autocast, the trainer builds the model in float64 (parity tests).
- bf16: autocast to bfloat16 on CPU or CUDA; parameters, gradients and AdamW state stay float32 (the
  master weights), so no loss scaling is needed.
- fp16: autocast to float16 with `DynamicLossScaler`: the loss is multiplied by the scale before
  backward; gradients are unscaled before clipping; a step whose gradients hold inf/nan on any rank is
  skipped everywhere and the scale halves; after `growth_interval` clean steps it doubles.

FSDP's own parameter and reduce dtypes (parallel.param_dtype / reduce_dtype) are a data-parallel setting:
`fourfold.parallel.fsdp.fsdp_dtypes` says what they mean.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fourfold.config import Config

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def master_dtype(precision: str) -> torch.dtype:
    """The dtype parameters, gradients and optimizer state are stored in: float64 for fp64 runs, else float32.

    bf16 and fp16 compute under autocast from float32 master weights; this is the one place that says so.
    """
    return torch.float64 if precision == "fp64" else torch.float32


@dataclass
class PrecisionPolicy:
    """How forward computes: the device type and the autocast dtype (None = off)."""

    device_type: str
    autocast_dtype: torch.dtype | None

    @classmethod
    def from_config(cls, cfg: Config, device: torch.device) -> "PrecisionPolicy":
        """The policy for the config's compute.precision on `device`."""
        mode = cfg.compute.precision
        return cls(device.type, DTYPES[mode] if mode in ("bf16", "fp16") else None)

    def autocast(self):
        """An autocast context in the policy's dtype, or a no-op context when autocast is off."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        # No weight cache: each weight is cast once per forward anyway, and the cache would keep every
        # checkpointed block's bf16 weight copies alive until forward ends (15 GiB for an 8B model),
        # which recomputation is meant to free.
        return torch.autocast(self.device_type, dtype=self.autocast_dtype, cache_enabled=False)


class DynamicLossScaler:
    """Loss scaling for fp16 that stays consistent across ranks holding sharded gradients."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, group=None):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.group = growth_interval, group
        self.clean_steps, self.skipped_steps = 0, 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the current scale."""
        return loss * self.scale

    @torch.no_grad()
    def unscale_and_check(self, params) -> bool:
        """Divide gradients by the scale in place; True when any rank found inf or nan (one host sync)."""
        grads = [p.grad for p in params if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        found = torch.zeros((), device=local[0].device if local else "cpu")
        for g in local:
            g.mul_(1.0 / self.scale)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        if dist.is_initialized():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step: back off if `found_inf`, grow after `growth_interval` clean steps in a row."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        """The scale and the step counters, for checkpoints."""
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore the scale and counters from `state_dict()`'s output."""
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
