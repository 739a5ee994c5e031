"""bf16 linears for CPU inference on weights packed once into oneDNN's blocked layout.

    packed = pack_cpu_linears(model)     # every bias-free bf16 nn.Linear -> PackedLinear; returns how many

A bf16 matrix product on CPU through `F.linear` reorders the weight into oneDNN's layout on every call;
packing it once (what inductor's CPU freezing pass does) saves that work each step: measured on this
2-core machine (CPU time, one thread, a 576 x 1536 SmolLM2-sized projection) 72 vs 126 us for one
token and 82 vs 133 us for 16, results bit-identical. The engine packs a model it loaded itself (not a
module a caller handed over) when it runs bf16 on the CPU without tensor parallelism; where the oneDNN
ops are missing, nothing is packed. The CPU step (fourfold.infer.cpu_decoder) then unpacks q, k, v and
w1, w3 once and packs each group as one matrix.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


class PackedLinear(nn.Module):
    """y = x W^T with W (out, in) held in oneDNN's packed layout (inference only)."""

    def __init__(self, weight: torch.Tensor, batch_hint: int = 16):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def bound(self):
        """x -> self(x) without the module call's overhead (for loops that run it thousands of times a second)."""
        op, packed = torch.ops.mkldnn._linear_pointwise.default, self.packed
        return lambda x: op(x, packed, None, "none", [], "")


@functools.cache
def packing_works() -> bool:
    """Whether this torch build has the oneDNN ops and they agree with F.linear on a small case."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(8, 16, dtype=torch.bfloat16)
        x = torch.randn(2, 16, dtype=torch.bfloat16)
        return torch.allclose(PackedLinear(w)(x).float(), nn.functional.linear(x, w).float(), rtol=1e-2, atol=1e-2)
    except (RuntimeError, AttributeError):
        return False


def pack_cpu_linears(model: nn.Module) -> int:
    """Replace every bias-free bf16 CPU nn.Linear of `model` by a PackedLinear, in place; the number replaced."""
    if not packing_works():
        return 0
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and child.bias is None and child.weight.dtype == torch.bfloat16
               and child.weight.device.type == "cpu" and type(child.weight.data) is torch.Tensor]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child.weight))
    return len(targets)
