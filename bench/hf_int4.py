"""The int4 peer of bench/generate.py: a transformers Llama whose decoder linears run torch's own int4 kernel.

    quantize_decoder_linears(hf_model, group_size=128)   # every nn.Linear under model.model.layers, in place

Torch's int4 weight-only matmul (`aten._weight_int4pack_mm` on weights tiled by `_convert_weight_to_int4pack`,
"tinygemm") is what gpt-fast and torchao's tile-packed int4 layout run on CUDA. It is written out here, not
taken from torchao, because torchao's default int4 kernels need a package (mslk) that does not install on the
GPU machines. Round to nearest, symmetric, one bf16 scale per group of `group_size` input columns; embeddings
and the output head stay bf16, as in fourfold's default conversion (`fourfold quantize` without --output).
On CPU the same module runs `_weight_int4pack_mm_for_cpu` (the tests use it).
"""

from __future__ import annotations

import torch
from torch import nn

from fourfold.quant.packing import cuda_inner_k_tiles, pack_int4, scales_and_zeros


def quantize_rtn(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, scales): u uint8 [N, K] in 0..15 with weight ~ (u - 8) * scale, scales float32 [N, K / group_size]."""
    n, k = weight.shape
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    scales = (groups.abs().amax(-1) / 7).clamp(min=1e-8)
    q = torch.clamp(torch.round(groups / scales[..., None]), -8, 7) + 8
    return q.reshape(n, k).to(torch.uint8), scales


def dequantize(u: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 [N, K]: (u - 8) * scale, the weight the kernel multiplies by."""
    n, k = u.shape
    return ((u.float() - 8).reshape(n, k // group_size, group_size) * scales[..., None]).reshape(n, k)


class TorchInt4Linear(nn.Module):
    """y = x @ ((u - 8) * scale).T (+ bias) through torch's int4 kernel for the weight's device (CPU or CUDA)."""

    def __init__(self, linear: nn.Linear, group_size: int) -> None:
        super().__init__()
        n, k = linear.weight.shape
        if k % group_size or n % 16:
            raise ValueError(f"torch's int4 kernel needs in_features divisible by {group_size} and out_features by 16, "
                             f"got {n} x {k}")
        self.group_size, self.in_features, self.out_features = group_size, k, n
        u, scales = quantize_rtn(linear.weight, group_size)
        dtype, device = linear.weight.dtype, linear.weight.device
        # the layouts torch's int4 kernels take (fourfold.quant.packing documents them); symmetric: zero points 0
        sz = scales_and_zeros(scales, torch.zeros_like(scales, dtype=torch.int8), dtype)
        if device.type == "cuda":
            packed = torch.ops.aten._convert_weight_to_int4pack(pack_int4(u), cuda_inner_k_tiles(k))
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32), 2)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", sz)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group_size, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


def check_against_dequantized(module: TorchInt4Linear, weight: torch.Tensor) -> None:
    """Raise unless `module` (made from `weight`) computes x @ dequantize(...).T on its device: on a GPU this checks
    the CUDA kernel's nibble order and scale layout, which the CPU tests cannot."""
    u, scales = quantize_rtn(weight, module.group_size)
    x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    want = x.float() @ dequantize(u, scales, module.group_size).T
    err = float((module(x).float() - want).norm() / want.norm())
    if not err < 2e-2:
        raise RuntimeError(f"torch's int4 kernel disagrees with the dequantized weight: relative error {err:.3g}")


def quantize_decoder_linears(model: nn.Module, group_size: int = 128) -> int:
    """Swap every nn.Linear of a transformers Llama's decoder layers for a TorchInt4Linear (the first one checked
    by check_against_dequantized); returns how many."""
    swapped = 0
    for layer in model.model.layers:
        for child in list(layer.modules()):
            for attr, sub in list(child.named_children()):
                if isinstance(sub, nn.Linear):
                    module = TorchInt4Linear(sub, group_size)
                    if not swapped:
                        check_against_dequantized(module, sub.weight)
                    setattr(child, attr, module)
                    swapped += 1
    return swapped
