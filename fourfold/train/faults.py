"""Fault injection for tests and demos: kill a chosen rank, or make its loss NaN, at a chosen step ([fault]).

    fourfold train --nproc 2 --max-restarts 1 --out runs/faulty --fault.kill_at_step 7 --fault.kill_rank 1
    fourfold train --out runs/nan --fault.nan_at_step 3 --fault.nan_steps 2

Faults fire only on a job's first attempt (torchrun's TORCHELASTIC_RESTART_COUNT is 0, or no torchrun at
all), so a job launched with restarts recovers from them and finishes. The kill is SIGKILL as the step
starts: no handler runs and nothing is flushed or saved, as when a machine is lost. The NaN is a forward
hook on this rank's model chunks that multiplies their output by NaN, so the loss, the gradients and the
global gradient norm all become NaN, as a real overflow would make them.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from torch import nn

from fourfold.config import FaultConfig
from fourfold.errors import ConfigError


class FaultInjector:
    """Carries out `[fault]`'s injected faults on this rank; does nothing when none is set or after a restart."""

    def __init__(self, cfg: FaultConfig, rank: int, world_size: int, attempt: int):
        for key, step, target in (("kill", cfg.kill_at_step, cfg.kill_rank), ("nan", cfg.nan_at_step, cfg.nan_rank)):
            if step and target >= world_size:
                raise ConfigError(f"fault.{key}_rank {target} is not a rank of this {world_size}-process job; set "
                                  f"--fault.{key}_rank between 0 and {world_size - 1}.")
        self.cfg, self.rank = cfg, rank
        self.active = attempt == 0
        self.step = 0
        """The step being computed (1-based), set by `before_step`."""

    def before_step(self, step: int) -> None:
        """Called as step `step` (1-based) starts: SIGKILL this process if this is the injected kill."""
        self.step = step
        if self.active and self.cfg.kill_at_step == step and self.rank == self.cfg.kill_rank:
            print(f"[fault] killing rank {self.rank} at step {step} (fault.kill_at_step)", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def poisons(self, step: int) -> bool:
        """True when this rank's loss at `step` is to be NaN."""
        first = self.cfg.nan_at_step
        return (self.active and first > 0 and self.rank == self.cfg.nan_rank
                and first <= step < first + self.cfg.nan_steps)

    def attach(self, chunks: list[nn.Module]) -> None:
        """Hook this rank's model chunks so their output is NaN at the poisoned steps (only when NaNs are injected)."""
        if not self.active or self.cfg.nan_at_step == 0 or self.rank != self.cfg.nan_rank:
            return
        for chunk in chunks:
            chunk.register_forward_hook(self._poison)

    def _poison(self, module: nn.Module, args, output):
        if isinstance(output, torch.Tensor) and module.training and self.poisons(self.step):
            return output * float("nan")
        return output
