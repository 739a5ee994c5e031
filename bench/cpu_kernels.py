"""Each fused CPU kernel (fourfold.infer.cpu_kernels) against the torch ops it replaces, side by side, SmolLM2-135M sizes.

    python bench/cpu_kernels.py [--threads 1] [--repeat 200] [--dtype bf16]

For every kernel and shape (decode at batch 1 and 16, a 64-token prefill) prints microseconds per call of
the torch reference (fourfold.testing.cpu_kernel_cases.REFERENCE: the ops cpu_decoder runs without the
kernels) and of the C kernel, in thread CPU time (the best of five rounds of `--repeat` calls: a shared
machine disturbs it less than wall time), and their ratio. Numbers are per call; a decode step makes
30 (layers) x 2 add+norm, 1 rotary+write, 1 attention and 1 SiLU*up calls.
"""

from __future__ import annotations

import argparse
import time

import torch

from fourfold.infer import cpu_kernels
from fourfold.testing.cpu_kernel_cases import FUSED, REFERENCE, kernel_case

CASES = [  # (label, kind, case arguments)
    ("add+norm b1", "add_rms_norm", dict(tokens=1)),
    ("add+norm b16", "add_rms_norm", dict(tokens=16)),
    ("rope+kv b1", "rope_write_kv", dict(lengths=[96])),
    ("rope+kv b16", "rope_write_kv", dict(lengths=[96] * 16)),
    ("attention b1 (96 keys)", "attention", dict(lengths=[96])),
    ("attention b16 (96 keys)", "attention", dict(lengths=[96 + i for i in range(16)])),
    ("attention prefill 64", "attention", dict(lengths=[64], new=[64])),
    ("silu*up b1", "silu_mul", dict(tokens=1)),
    ("silu*up b16", "silu_mul", dict(tokens=16)),
]


def per_call_us(fn, repeat: int) -> float:
    """Best-of-five thread CPU microseconds per call of fn()."""
    best = float("inf")
    for _ in range(5):
        start = time.thread_time()
        for _ in range(repeat):
            fn()
        best = min(best, (time.thread_time() - start) / repeat)
    return 1e6 * best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    k = cpu_kernels.load()
    if k is None:
        raise SystemExit("the C kernels did not build (run with logging at DEBUG to see why)")
    print(f"{'kernel':<26} {'torch us':>9} {'C us':>8} {'ratio':>6}   ({a.dtype}, {a.threads} threads, thread CPU time)")
    with torch.inference_mode():
        for label, kind, args in CASES:
            case = kernel_case(kind, dtype=dtype, **args)
            case["in_place"] = True  # time the pool writes, not copies of the pool
            ref = per_call_us(lambda: REFERENCE[kind](case), a.repeat)
            ours = per_call_us(lambda: FUSED[kind](k, case), a.repeat)
            print(f"{label:<26} {ref:>9.1f} {ours:>8.1f} {ref / ours:>6.2f}")


if __name__ == "__main__":
    main()
