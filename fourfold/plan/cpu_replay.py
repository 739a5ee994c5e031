"""Replays a traced step's own ops on real tensors, one distinct call at a time, and times each: per-op factors.

    calls = traced_calls(ops_fn)                 # run ops_fn under the recorder, keep each call's arguments
    seconds = replay_seconds(calls, threads=1)   # {signature: fastest thread-time seconds of one call}
    factors = op_factors(reference_config(), table_costs, threads=1)   # {'mm': 1.17, 'silu_backward': 3.0, ...}

The CPU step model (fourfold/plan/cpu_steptime.py) prices each op from rate tables measured on square GEMMs
and plain multiplies. A training step's GEMMs are rectangular and many of its element-wise ops broadcast, read
strided views or compute more per byte (SiLU's backward, RMSNorm's pow and rsqrt), so the tables price them
too cheaply. `fourfold plan calibrate` therefore runs the step of a reference Llama (not a validation model)
on fake tensors, rebuilds every distinct (op, shapes, strides, dtypes, arguments) call on real tensors, times
it alone (the fastest of a few calls, CPU time of this thread on one thread, so other processes on the machine
disturb it little) and stores per op name the ratio of the replayed time to the tables' price: the
[cpu] table's `op_factor_1` / `op_factor_n`. Predictions stay a pure function of the calibration file.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

SKIP = {"_local_scalar_dense", "item", "lift_fresh", "_to_copy_meta", "empty", "empty_like", "empty_strided",
        "zeros", "ones", "full", "scalar_tensor", "randint", "random_", "normal_", "uniform_", "set_", "resize_"}
"""Ops not replayed: host reads, allocations and random fills (priced by the fixed op cost alone)."""


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument of a recorded call: enough to rebuild an equal-shaped real tensor."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    storage: int
    """Elements of the storage the view lives in."""


def spec_of(x):
    """`x` with every tensor replaced by its TensorSpec (lists and tuples walked), other values kept."""
    if isinstance(x, torch.Tensor):
        if hasattr(x, "_local_tensor"):  # a DTensor: the local shard is what the kernel runs on
            x = x._local_tensor
        storage = x.untyped_storage().nbytes() // max(1, x.element_size())
        return TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype, x.storage_offset(), storage)
    if isinstance(x, (list, tuple)):
        return tuple(spec_of(v) for v in x)
    if isinstance(x, (torch.device, torch.dtype, torch.layout, torch.memory_format)) or x is None:
        return x
    if isinstance(x, (int, float, bool, str)):
        return x
    return None


def _build(spec, generator: torch.Generator):
    if isinstance(spec, TensorSpec):
        n = max(spec.storage, spec.offset + 1)
        if spec.dtype.is_floating_point:
            base = torch.rand(n, generator=generator).to(spec.dtype) + 0.5
        elif spec.dtype == torch.bool:
            base = torch.ones(n, dtype=torch.bool)
        else:
            base = torch.zeros(n, dtype=spec.dtype)
        return base.as_strided(spec.shape, spec.stride, spec.offset)
    if isinstance(spec, tuple):
        return [_build(s, generator) for s in spec]
    return spec


def replay_one(func, args_spec, kwargs_spec, repeats: int = 3) -> float | None:
    """Fastest of `repeats` CPU-time seconds (this thread) of one call of `func` on real tensors of the recorded
    shapes (a warm-up call first; fresh tensors for in-place ops each time), or None when it cannot be replayed."""
    g = torch.Generator().manual_seed(0)
    best = float("inf")
    try:
        for i in range(repeats + 1):
            args = [_build(a, g) for a in args_spec]
            kwargs = {k: _build(v, g) for k, v in kwargs_spec.items()}
            start = time.thread_time()
            func(*args, **kwargs)
            elapsed = time.thread_time() - start
            if i:
                best = min(best, elapsed)
    except Exception:  # an op whose random arguments it refuses: priced by the tables alone
        return None
    return best
