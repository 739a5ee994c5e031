"""AdamW with decay groups, clipping folded into the fused kernel, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from fourfold.config import OptimConfig


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two parameter groups: matrices and embeddings decay, norms (1-D parameters) do not."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw_kwargs(cfg: OptimConfig, device: torch.device) -> dict:
    """AdamW arguments; the fused implementation where the device supports it (CUDA), foreach otherwise."""
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if device.type == "cuda":
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = True
    return kwargs


def build_adamw(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over `model` with decay groups and the config's hyperparameters (fused on CUDA)."""
    return torch.optim.AdamW(decay_groups(model, cfg.weight_decay), **adamw_kwargs(cfg, device))


def folds_clipping(optimizer: torch.optim.Optimizer) -> bool:
    """True when `optimizer` can clip inside its own kernel: torch's fused AdamW over plain tensors.

    The fused kernel divides every gradient by the optimizer's `grad_scale` tensor (the hook torch's
    GradScaler uses to unscale), so the clip costs no separate pass over the gradients (about 1.5 ms a
    step for 1B fp32 gradients on an H100). DTensor parameters (FSDP, TP) take the explicit path.
    """
    if not (isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults.get("fused")):
        return False
    return not any(hasattr(p, "device_mesh") for group in optimizer.param_groups for p in group["params"])


def fold_clip(optimizer: torch.optim.Optimizer, total_norm: torch.Tensor, max_norm: float) -> None:
    """Make the next fused step scale gradients by min(1, max_norm / (total_norm + 1e-6)), as torch's clipping does.

    `max_norm` 0 turns the scaling off. The divisor stays on the device: no host synchronisation.
    """
    if max_norm <= 0:
        optimizer.grad_scale = None
        return
    divisor = (total_norm.float() + 1e-6) / max_norm
    optimizer.grad_scale = torch.clamp(divisor, min=1.0)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine down to min_lr_ratio * lr."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
