"""The step-runner interface: what one optimizer step computes on this rank, whatever the layout.

    runner = build_runner(cfg, mesh, dp, chunks, device)     # fourfold.train.runner picks the kind once
    loss, grad_norm, skipped = runner.step(micro_batches)    # forward+backward, gradients ready to step
    if not skipped:
        runner.optimizer.step()
    runner.optimizer.zero_grad(set_to_none=True)
    val = runner.global_mean(runner.evaluate(val_batches))

A runner owns the model (`model`: one module holding every trainable parameter of this rank), its
optimizer, the loss of the layout, the batch sharding (context parallel), the precision (autocast and
the fp16 loss scaler) and the finishing of gradients after the last backward: the tensor-parallel
partial-gradient settle, the fp16 unscale and inf/nan check, the global gradient norm and clipping. The
trainer owns the learning rate, stepping the optimizer, logging, validation and checkpoints.

The loss of a step is the mean over the trained tokens of the whole global batch (targets equal to
IGNORE_INDEX, chat prompts and padding, are not trained), not a mean of per-micro-batch means: so
neither gradient accumulation nor the data-parallel degree changes it. Each micro-batch's loss is the
SUM of its tokens' losses divided by `loss_divisor` = (trained tokens of the global batch) / (micro-batches
x ranks whose gradients are averaged, dp * fsdp * cp); divided again by the number of micro-batches and
averaged over those ranks, the gradients add up to the gradient of that global token mean. The count
comes from one all-reduce of a scalar per step (every rank counts its own micro-batches' trained
targets; tp, cp and pp replicas of a data rank count the same batches and are divided out). With every
target trained (text data) the divisor is the tokens of one local micro-batch: the plain token mean.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fourfold.config import Config
from fourfold.mesh import ParallelMesh
from fourfold.ops.cross_entropy import IGNORE_INDEX
from fourfold.parallel.context import shard_batch as shard_for_context
from fourfold.parallel.data_parallel import DataParallel
from fourfold.parallel.tensor import settle_partial_grads
from fourfold.precision import DynamicLossScaler, PrecisionPolicy
from fourfold.train.losses import build_loss

# Ranks holding a replica of the same data and parameters along these dimensions write nothing.
REPLICA_DIMS = ("dp", "fsdp", "cp", "tp")


class StepResult(NamedTuple):
    """One step on this rank: its mean loss (a detached tensor), the global gradient norm, and whether the
    fp16 loss scaler found inf/nan (then the optimizer must not step)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    skipped: bool


@dataclass
class RunReport:
    """What a runner has to say at the end of a run: a metrics record (the trainer adds the step) and lines
    for the console. Only rank 0's report carries anything."""

    record: dict = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)


def as_plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the vocab-parallel loss) as an ordinary tensor, for accumulation."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class StepRunner(ABC):
    """Forward, backward and gradient finishing of one optimizer step over this rank's model chunks."""

    def __init__(self, cfg: Config, mesh: ParallelMesh, dp: DataParallel, chunks: list[nn.Module],
                 device: torch.device):
        self.cfg, self.mesh, self.dp, self.device = cfg, mesh, dp, torch.device(device)
        self.chunks = chunks
        self.model = self._one_module(chunks)
        self.optimizer = dp.build_optimizer(self.model)
        self.autocast = PrecisionPolicy.from_config(cfg, self.device).autocast
        self.scaler = DynamicLossScaler(group=None) if cfg.compute.precision == "fp16" else None
        self.loss_fn, self.loss_context = build_loss(cfg, mesh)
        """loss_fn(logits, targets): the SUM of the trained tokens' losses (see `token_loss` for the step's loss)."""
        self.loss_divisor = torch.ones((), dtype=torch.float64)
        """What `token_loss` divides a micro-batch's summed loss by; set for each step by `set_loss_divisor`."""
        self._gradient_ranks = mesh.data_parallel_size * mesh.size("cp")
        self._replicas_of_data_rank = mesh.world_size // mesh.data_parallel_size
        self.shard_batch = None
        """Context parallel: (inputs, targets) -> (inputs, targets, positions) of this rank's part of the sequence."""
        if mesh.size("cp") > 1:
            self.shard_batch = functools.partial(shard_for_context, cp_rank=mesh.coord("cp"), cp=mesh.size("cp"))
        self.settles_partial_grads = mesh.size("tp") > 1

    # ----- the interface ------------------------------------------------------------------------
    def step(self, micro_batches: list) -> StepResult:
        """Forward and backward over this rank's `micro_batches` [(inputs, targets)], then finish the gradients."""
        loss = self._forward_backward(micro_batches)
        grad_norm, skipped = self._finish_gradients()
        return StepResult(loss, grad_norm, skipped)

    @abstractmethod
    def evaluate(self, batches: list) -> torch.Tensor:
        """This rank's mean loss over validation `batches` (a tensor; `global_mean` averages it over ranks)."""

    def global_mean(self, value: torch.Tensor) -> float:
        """Average a per-rank loss over the ranks that hold distinct data (replicas count once)."""
        if not dist.is_initialized():
            return float(value)
        t = value.detach().double().reshape(1).clone()
        dist.all_reduce(t)
        return float(t) / self._ranks_with_loss()

    @property
    def checkpoint_modules(self) -> nn.Module | list[nn.Module]:
        """What save_checkpoint/load_checkpoint take for this rank: the model, or the list of pipeline chunks."""
        return self.model

    @property
    def checkpoint_shard(self) -> tuple[bool, str]:
        """(whether this rank writes its parameters, the name of its shard file)."""
        return all(self.mesh.coord(d) == 0 for d in REPLICA_DIMS), "model"

    def report(self, run_dir: Path) -> RunReport | None:
        """The end-of-run report (every rank calls it; collective where a runner needs one), or None."""
        return None

    # ----- what each kind of runner supplies ----------------------------------------------------
    @staticmethod
    def _one_module(chunks: list[nn.Module]) -> nn.Module:
        """The module the optimizer, clipping and memory report see."""
        (model,) = chunks
        return model

    @abstractmethod
    def _forward_backward(self, micro_batches: list) -> torch.Tensor:
        """Accumulate the step's gradients into the parameters' `.grad`; return this rank's mean loss."""

    @abstractmethod
    def _clip(self) -> torch.Tensor:
        """Clip the gradients by the global norm (optim.grad_clip; 0: no clipping); return that norm."""

    @abstractmethod
    def _ranks_with_loss(self) -> int:
        """How many ranks' losses `global_mean` adds up (ranks without a loss add zero)."""

    # ----- shared -------------------------------------------------------------------------------
    def _finish_gradients(self) -> tuple[torch.Tensor, bool]:
        """After the last backward: settle partial sums (tp), unscale and check (fp16), clip by the global norm."""
        params = list(self.model.parameters())
        if self.settles_partial_grads:
            settle_partial_grads(params)
        skipped = self.scaler.unscale_and_check(params) if self.scaler is not None else False
        grad_norm = self._clip()
        if self.scaler is not None:
            self.scaler.update(skipped)
        return grad_norm, skipped

    def set_loss_divisor(self, batches: list) -> None:
        """Set `loss_divisor` for these micro-batches [(inputs, targets, ...)] of this rank (a collective when
        distributed: every rank calls it with the same number of micro-batches)."""
        counts = [(batch[1] != IGNORE_INDEX).sum() for batch in batches]
        trained = (torch.stack(counts).sum().to(self.device, torch.float64) if counts
                   else torch.zeros((), dtype=torch.float64, device=self.device))
        if dist.is_initialized() and self.mesh.world_size > 1:
            dist.all_reduce(trained)
            trained = trained / self._replicas_of_data_rank
        self.loss_divisor = trained.clamp(min=1) / (max(1, len(batches)) * self._gradient_ranks)

    def _reshard(self) -> None:
        """Free the parameters a forward without backward left gathered (FSDP2 reshards the root module only
        in backward): afterwards the model holds its sharded parameters again, the ones the optimizer and
        checkpoints name."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def token_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A micro-batch's share of the global token-mean loss: its summed loss over `loss_divisor`."""
        return self.loss_fn(logits, targets) / self.loss_divisor

    def _scaled_for_backward(self, loss: torch.Tensor, n_micro: int) -> torch.Tensor:
        """One micro-batch's share of the step's mean loss, times the fp16 loss scale if there is one."""
        scaled = loss / n_micro
        return self.scaler.scale_loss(scaled) if self.scaler is not None else scaled
