"""Accelerator facts used for MFU: peak dense bf16 FLOP/s by GPU name, and peak memory readings.

MFU = achieved model FLOP/s / peak dense bf16 FLOP/s of the GPU. The peaks are the vendors' datasheet
figures for dense (not sparse) bf16 tensor-core math; unknown GPUs and CPUs report no MFU.
"""

from __future__ import annotations

import resource
import sys

import torch

# Datasheet dense bf16 tensor-core peaks, FLOP/s. Matched by substring of torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 80GB HBM3": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "RTX 4090": 165e12,
}


def peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of `device`, or None for CPUs and unknown GPUs."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value
    return None


DEVICE_KINDS = {"H200": "h200", "H100": "h100", "A100": "a100", "B200": "b200"}
"""Substring of torch.cuda.get_device_name() -> the device name in the planner's hardware table."""


def device_kind(device: torch.device) -> str | None:
    """The planner's name for `device` ('cpu', 'h100', ...), or None for a GPU the table does not know."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    return next((kind for key, kind in DEVICE_KINDS.items() if key in name), None)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: the CUDA allocator's peak on GPUs, the process's peak resident set on CPUs."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def reset_peak_memory(device: torch.device) -> None:
    """Reset the CUDA allocator's peak-memory counter; does nothing on CPUs (their peak cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
