"""What every fourfold Triton kernel shares: the optional Triton import, programmatic dependent launch, SwiGLU rounding.

    from fourfold.ops.triton_launch import triton, pdl        # triton is None on installs without it
    kernel[grid](..., PDL=pdl(x.device), launch_pdl=pdl(x.device))
    # inside a kernel: pdl_signal(PDL); pdl_wait(PDL) before reading what the previous kernel wrote

The inference kernels (fourfold.infer.attention_gpu, fused_ops, gemv_gpu) and the int4 GEMV
(fourfold.quant.int4_gemv) import these from here, so one rule decides where PDL is on.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU installs: callers fall back to torch
    triton = None

_pdl_devices: dict = {}


def pdl(device: torch.device) -> bool:
    """Whether kernels launch with programmatic dependent launch on `device` (Hopper or newer, not under
    TRITON_INTERPRET). Then each kernel lets the next one start while it runs (`pdl_signal`) and waits for
    the previous one (`pdl_wait`) before it reads what that one wrote or writes anything, so launch latency
    and the GEMVs' first weight loads overlap the previous kernel; captured CUDA graphs keep these edges.
    FOURFOLD_PDL=0 turns it off."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("FOURFOLD_PDL") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _pdl_devices:
        _pdl_devices[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _pdl_devices[index]


if triton is not None:

    @triton.jit
    def pdl_signal(PDL: tl.constexpr):
        """Let the next kernel launch now (it waits in pdl_wait); a no-op unless launched with PDL."""
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait until the previous kernel has finished and its writes are visible."""
        if PDL:
            gdc_wait()

    @triton.jit
    def swiglu_rounded(gate, up, out_ptr):
        """silu(gate) * up in float32 from float32 matmul sums, rounded to out_ptr's dtype where the eager
        SwiGLU rounds: each matmul output, the silu, (by the caller's store) the product."""
        out_ty = out_ptr.dtype.element_ty
        g = gate.to(out_ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
        return act * up.to(out_ty).to(tl.float32)
