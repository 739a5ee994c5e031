"""GPTQ-style post-training quantization: round a linear's weights one input column at a time and fold each column's
rounding error into the columns not yet rounded, weighted by the layer's input statistics (Frantar et al., 2022).

    modules = gptq_modules(model, [(name, linear), ...], scheme, calibration)   # {name: Int4/Int8WeightLinear}

What it minimises, per linear: the error of the layer's *outputs* on the calibration inputs X,
||X W^T - X W_hat^T||^2 = tr((W - W_hat) H (W - W_hat)^T) with H = X^T X / n, rather than the weights' own
rounding error (round to nearest). The integers, scales and zero points land in the very packed modules that
round to nearest produces (fourfold-packed-v1), so conversion, checkpoints and the engine take them unchanged.

Choices (own code, plain PyTorch):
- Layers go in model order, one transformer block at a time. The calibration batches run through the model
  once, up to the first block, whose inputs are kept; each block then runs on its kept inputs (hooks add up
  every target linear's H), is rounded, and runs again, rounded, to give the next block its inputs: a block
  is calibrated on what the quantized model will feed it, at one block's cost per block. A quantized head
  (outside the blocks) is calibrated by one more whole forward.
- Scales and zero points use the scheme's own formula (fake_quant.weight_qparams: min/max of the group, scale
  rounded to the scheme's dtype), computed for each group from its columns *after* the errors of the earlier
  groups were folded in, as GPTQ does with groups. Per-channel int8 takes its scales from the whole weight first.
- Columns in their natural order (no activation ordering, so a group is contiguous, as the packed format
  needs); dampening 1% of H's mean diagonal; an input feature that never fires (H_ii = 0) is rounded to zero.
- 8da4w's activations are quantized at run time as always; H comes from the unquantized inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from fourfold.quant.fake_quant import dequantize_weight, weight_qparams
from fourfold.quant.packing import Int4WeightLinear, Int8WeightLinear, pack_int4
from fourfold.quant.schemes import QuantScheme

DAMP = 0.01


class _StopForward(Exception):
    """Raised by a hook after the block being calibrated: nothing later in the model needs to run."""


@torch.no_grad()
def input_hessians(linears: dict[str, nn.Linear], run: Callable[[], None]) -> dict[str, torch.Tensor]:
    """{name: X^T X / n} (float32, [in, in]) of each linear's inputs X over the forwards that `run()` makes."""
    device = next(iter(linears.values())).weight.device
    sums = {n: torch.zeros(m.in_features, m.in_features, device=device) for n, m in linears.items()}
    rows = dict.fromkeys(linears, 0)

    def record(name):
        def hook(module, args):
            x = args[0].detach().reshape(-1, module.in_features).float()
            sums[name].addmm_(x.T, x)
            rows[name] += x.shape[0]
        return hook

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in linears.items()]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return {n: sums[n] / max(1, rows[n]) for n in linears}


@torch.no_grad()
def block_inputs(model: nn.Module, first_block: nn.Module, calibration: Iterable[torch.Tensor]) -> list[tuple]:
    """(args, kwargs) that `first_block` receives for each calibration batch; the forward stops there."""
    device = next(model.parameters()).device
    kept = []

    def keep(module, args, kwargs):
        kept.append((args, kwargs))
        raise _StopForward

    hook = first_block.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        for tokens in calibration:
            try:
                model(tokens.to(device))
            except _StopForward:
                pass
    finally:
        hook.remove()
    return kept


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, scheme: QuantScheme, *, damp: float = DAMP,
                  block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ints [N, K] int8, scales [N, groups], zero points [N, groups] int8), as quantize_weight returns, for
    the weight [N, K] whose inputs have second moment `hessian` [K, K]."""
    w = weight.detach().float().clone()
    n, k = w.shape
    h = hessian.detach().float().clone().to(w.device)
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diagonal(h).mean() * torch.eye(k, device=w.device)
    # Upper Cholesky factor of H^-1: row i holds how the columns after i absorb column i's error.
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h.double())), upper=True).float()
    group = scheme.group_size
    if group is None:
        scales, zeros = weight_qparams(w, scheme)         # per channel: [N, 1] from the whole weight
    else:
        scales = torch.empty(n, k // group, dtype=scheme.torch_scale_dtype, device=w.device)
        zeros = torch.empty(n, k // group, dtype=torch.int8, device=w.device)
        block = max(group, block // group * group)        # a group never straddles two blocks
    q = torch.empty(n, k, dtype=torch.int8, device=w.device)
    for b0 in range(0, k, block):
        b1 = min(k, b0 + block)
        wb, ub, err = w[:, b0:b1].clone(), u[b0:b1, b0:b1], torch.empty(n, b1 - b0, device=w.device)
        for j in range(b1 - b0):
            col = b0 + j
            g = 0 if group is None else col // group
            if group is not None and col % group == 0:
                scales[:, g:g + 1], zeros[:, g:g + 1] = weight_qparams(wb[:, j:j + group], scheme)
            s, z = scales[:, g].float(), zeros[:, g].float()
            qc = (torch.round(wb[:, j] / s) + z).clamp(scheme.qmin, scheme.qmax)
            q[:, col] = qc.to(torch.int8)
            err[:, j] = (wb[:, j] - (qc - z) * s) / ub[j, j]
            wb[:, j + 1:] -= err[:, j:j + 1] * ub[j, j + 1:]
        w[:, b1:] -= err @ u[b0:b1, b1:]
    return q, scales, zeros


def packed_linear(linear: nn.Linear, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  scheme: QuantScheme) -> nn.Module:
    """The packed module (the class and layout Int4WeightLinear / Int8WeightLinear.from_float produce) holding
    the given integers, scales and zero points."""
    bias = linear.bias is not None
    if scheme.weight_bits == 4:
        out = Int4WeightLinear(linear.in_features, linear.out_features, bias, scheme)
        out.weight_int4.copy_(pack_int4((q.to(torch.int16) + 8).cpu()))
        out.scales.copy_(scales)
        out.zero_points.copy_(zeros)
    else:
        out = Int8WeightLinear(linear.in_features, linear.out_features, bias, scheme)
        out.weight_int8.copy_(q)
        out.scales.copy_(scales[:, 0])
    if bias:
        out.bias = linear.bias.detach().clone()
    return out.to(linear.weight.device)


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformer blocks ("layers.<i>") in the order the forward runs them."""
    return [(n, m) for n, m in model.named_modules() if n.startswith("layers.") and n.count(".") == 1]


def _round_stage(stage: dict[str, nn.Linear], hessians: dict, scheme: QuantScheme, damp: float, out: dict) -> None:
    for name, linear in stage.items():
        q, scales, zeros = gptq_quantize(linear.weight, hessians[name], scheme, damp=damp)
        linear.weight.copy_(dequantize_weight(q, scales, zeros, scheme, linear.weight.dtype))
        out[name] = packed_linear(linear, q, scales, zeros, scheme)


@torch.no_grad()
def gptq_modules(model: nn.Module, linears: list[tuple[str, nn.Linear]], scheme: QuantScheme,
                 calibration: list[torch.Tensor], *, damp: float = DAMP) -> dict[str, nn.Module]:
    """{name: packed module} for every linear of `linears`, rounded by GPTQ block after block. Each linear's
    float weight is replaced in place by its rounded value as it goes (so later blocks calibrate on the
    quantized model's inputs); the caller swaps in the returned modules."""
    by_block: dict[str, dict] = {}
    for name, module in linears:
        parts = name.split(".")
        by_block.setdefault(".".join(parts[:2]) if parts[0] == "layers" else "", {})[name] = module
    was_training = model.training
    model.eval()
    out: dict[str, nn.Module] = {}
    try:
        blocks, left = _blocks(model), sum(1 for k in by_block if k)
        inputs = block_inputs(model, blocks[0][1], calibration) if left else []
        for block_name, block in blocks:
            if not left:
                break
            if block_name in by_block:
                def run(block=block):
                    for args, kwargs in inputs:
                        block(*args, **kwargs)
                _round_stage(by_block[block_name], input_hessians(by_block[block_name], run), scheme, damp, out)
                left -= 1
            inputs = [((block(*args, **kwargs), *args[1:]), kwargs) for args, kwargs in inputs]
        if "" in by_block:   # the head: one whole forward of the (already rounded) model
            device = next(model.parameters()).device
            hessians = input_hessians(by_block[""], lambda: [model(t.to(device)) for t in calibration])
            _round_stage(by_block[""], hessians, scheme, damp, out)
    finally:
        model.train(was_training)
    return out
