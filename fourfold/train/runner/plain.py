"""The plain step runner: the whole model on every rank of its data group (one process, DDP, ZeRO, FSDP, TP, CP).

Gradient accumulation runs the micro-batches one after the other; data-parallel communication is
deferred to the last micro-batch's backward (`dp.grad_sync`), and the clip is the data-parallel
strategy's own (it folds into fused AdamW where it can).
"""

from __future__ import annotations

import torch

from fourfold.train.runner.base import StepRunner, as_plain_tensor


class PlainRunner(StepRunner):
    """Every micro-batch through the one model chunk, forward then backward."""

    def grad_sync(self, enabled: bool):
        """The data-parallel context for one backward; `enabled=False` defers gradient communication."""
        return self.dp.grad_sync(self.model, enabled)

    def _prepare(self, inputs: torch.Tensor, targets: torch.Tensor):
        """(inputs, targets, positions) on the device; positions are None unless context parallel shards."""
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        if self.shard_batch is not None:
            return self.shard_batch(inputs, targets)
        return inputs, targets, None

    def _forward_backward(self, micro_batches: list) -> torch.Tensor:
        n = len(micro_batches)
        self.set_loss_divisor(micro_batches)
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for i, (inputs, targets) in enumerate(micro_batches):
            inputs, targets, positions = self._prepare(inputs, targets)
            with self.grad_sync(i == n - 1), self.loss_context():
                with self.autocast():
                    logits = self.model(inputs, positions)
                loss = self.token_loss(logits, targets)
                self._scaled_for_backward(loss, n).backward()
            total += as_plain_tensor(loss.detach())
        return total / n

    @torch.no_grad()
    def evaluate(self, batches: list) -> torch.Tensor:
        self.set_loss_divisor(batches)
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        for inputs, targets in batches:
            inputs, targets, positions = self._prepare(inputs, targets)
            with self.loss_context(), self.autocast():
                total += as_plain_tensor(self.token_loss(self.model(inputs, positions), targets)).double()
        self._reshard()
        return total / max(1, len(batches))

    def _clip(self) -> torch.Tensor:
        return self.dp.clip_grad_norm(self.model, self.cfg.optim.grad_clip, self.optimizer)

    def _ranks_with_loss(self) -> int:
        # Every rank holds a loss: tp replicas repeat theirs, cp ranks each average an equal share of tokens.
        return self.mesh.world_size
