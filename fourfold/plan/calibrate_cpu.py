"""`fourfold plan calibrate` on CPUs: micro-benchmarks for the [cpu] table the CPU step model reads.

    table = measure_cpu(quick=False)     # {'cores': 2, 'op_overhead': ..., 'matmul_rate_1': [...], ...}
    table |= gloo_table(quick=False)     # calibrate_gloo.py: latency, bandwidth, comm_factor, tp_linear, fsdp_unit
    table |= reference_table(table)      # calibrate_reference.py: step factors, dtensor_op, fsdp_hook
    cpu_table_toml(table)                # the [cpu] table's TOML lines

Each figure is the best (fastest) of a few repeats, so that other processes on the machine disturb it
less; nothing here looks at a training run. Measured: the fixed cost of a dispatched op (a chain of tiny
element-wise ops forward and backward, divided by the ops the recorder of fourfold/plan/cpu_trace.py counts),
of a view, of one tensor in a foreach op; fp32 GEMM rates for calls from 16^3 to 1024^3 (the mean of the
three operand layouts a linear uses) and element-wise rates for calls from 4 KiB to 48 MiB, on one thread
and on every core, operands cycling through 128 MiB of buffers so that they come from memory as in a step; the CPU flash-attention kernel forward
and backward. The gloo figures (fourfold/plan/calibrate_gloo.py): latency and bandwidth of all-reduce,
all-gather, reduce-scatter, broadcast and send/receive between two processes, what a tensor-parallel
(DTensor) linear adds to a plain one, and what one FSDP2 unit adds to a forward + backward.
"""

from __future__ import annotations

import os
import time

import torch

from fourfold.plan.cpu_trace import OpRecorder

MATMUL_SIDES = (16, 32, 64, 128, 256, 512, 1024)
ELEMENTWISE_NUMELS = (341, 4096, 65536, 262144, 1048576, 4194304)


def best_seconds(fn, repeats: int = 5, inner: int = 1) -> float:
    """The fastest of `repeats` timings of `inner` calls of `fn`, per call (after one warm-up call). Timings are
    kept short (a fraction of a millisecond where the call allows) and many, so that on a shared machine the
    fastest falls in a moment no other process ran."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def _inner(seconds_guess: float) -> int:
    return max(1, min(500, int(3e-4 / max(seconds_guess, 1e-7))))


def op_overhead(repeats: int) -> float:
    """Seconds per dispatched op of a forward + backward chain over 4-element tensors."""
    x = torch.ones(4, requires_grad=True)

    def chain():
        y = x
        for _ in range(20):
            y = y * 1.5 + 1.0
        y.sum().backward()

    recorder = OpRecorder()
    with recorder:
        chain()
    return best_seconds(chain, repeats, 2) / len(recorder.ops)


def call_overhead(repeats: int) -> float:
    """Seconds of one tiny op called without autograd: what the rate tables take out of each timing (the
    step model charges `op_overhead` per op instead)."""
    a, b = torch.ones(4), torch.ones(4)
    return best_seconds(lambda: torch.mul(a, b), repeats, 50)


def view_overhead(repeats: int) -> float:
    """Seconds per view op (`t()` of a small matrix)."""
    x = torch.ones(4, 4)
    return best_seconds(lambda: [x.t() for _ in range(100)], repeats, 10) / 100


def foreach_tensor(repeats: int, op_cost: float) -> float:
    """Seconds per tensor of a foreach op over many tiny tensors (its one op cost taken out)."""
    pool = _pool(lambda: [torch.ones(4) for _ in range(256)], 4096.0)
    return max(1e-9, (_cycled(lambda xs: torch._foreach_add_(xs, 1.0), pool, repeats, 20) - op_cost) / 256)


COLD_BYTES = 128 * 2**20
"""Operands cycle through buffers of this many bytes in all, more than a last-level cache holds: in a training
step an op's inputs were written many ops earlier, so they come from memory, not from the cache."""


def _pool(make, nbytes_each: float) -> list:
    """Enough fresh operand sets (from `make()`) to cover COLD_BYTES, at most 4096."""
    return [make() for _ in range(int(min(4096, max(2, COLD_BYTES // max(nbytes_each, 1)))))]


def _cycled(fn_of, pool: list, repeats: int, calls: int) -> float:
    """Best-of-`repeats` seconds per call of fn_of(operands), cycling through `pool`, less the cycling's own cost."""
    state = {"i": 0}

    def one(fn=fn_of):
        fn(pool[state["i"] % len(pool)])
        state["i"] += 1

    idle = best_seconds(lambda: one(lambda _: None), repeats, 50)
    return max(best_seconds(one, repeats, calls) - idle, 1e-9)


def matmul_rates(repeats: int, op_cost: float, threads: tuple[int, ...]) -> tuple[list[float], list[list[float]]]:
    """(FLOPs per call, FLOP/s with the op cost taken out at each of `threads`) of square fp32 GEMMs, the mean
    over the three operand layouts a linear's forward and backward use (A B^T, A B, A^T B), operands cold."""
    flops, rates = [], [[] for _ in threads]
    layouts = (lambda ab: ab[0] @ ab[1].t(), lambda ab: ab[0] @ ab[1], lambda ab: ab[0].t() @ ab[1])
    for n in MATMUL_SIDES:
        pool = _pool(lambda: (torch.ones(n, n), torch.ones(n, n)), 8.0 * n * n)
        f = 2.0 * n**3
        flops.append(f)
        for i, k in enumerate(threads):
            torch.set_num_threads(k)
            t = sum(_cycled(fn, pool, repeats, _inner(f / 1e11)) for fn in layouts) / len(layouts)
            rates[i].append(f / max(t - op_cost, 0.1 * t))
    return flops, rates


def elementwise_rates(repeats: int, op_cost: float, threads: tuple[int, ...]) -> tuple[list[float], list[list[float]]]:
    """(bytes per call: two inputs and the output, bytes/s with the op cost taken out at each of `threads`) of
    fp32 multiplies, operands cold."""
    sizes, rates = [], [[] for _ in threads]
    for n in ELEMENTWISE_NUMELS:
        nbytes = 12.0 * n
        pool = _pool(lambda: (torch.ones(n), torch.ones(n)), 8.0 * n)
        sizes.append(nbytes)
        for i, k in enumerate(threads):
            torch.set_num_threads(k)
            t = _cycled(lambda ab: torch.mul(*ab), pool, repeats, _inner(nbytes / 5e9))
            rates[i].append(nbytes / max(t - op_cost, 0.1 * t))
    return sizes, rates


def attention_rates(repeats: int) -> tuple[float, float]:
    """(forward, backward) causal FLOP/s of the CPU flash-attention kernel at (4, 4, 256, 64)."""
    q, k, v = (torch.randn(4, 4, 256, 64, requires_grad=True) for _ in range(3))
    flops = 2.0 * q.numel() * 256
    fwd = best_seconds(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), repeats)

    def both():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    total = best_seconds(both, repeats)
    return flops / fwd, flops / max(total - fwd, 0.1 * total)


def measure_cpu(quick: bool = False) -> dict:
    """The one-process keys of the [cpu] table (fourfold.plan.cpu_costs.CpuCosts), measured on this machine
    (fourfold.plan.calibrate_gloo.gloo_table measures the rest)."""
    repeats = 8 if quick else 30  # many short timings: the fastest finds a moment the machine was free
    cores = os.cpu_count() or 1
    saved = torch.get_num_threads()
    table: dict = {"cores": cores}
    try:
        torch.set_num_threads(1)
        table["op_overhead"] = op_overhead(repeats)
        table["view_overhead"] = view_overhead(repeats)
        call = call_overhead(repeats)
        table["foreach_tensor"] = foreach_tensor(repeats, call)
        threads = (1, cores)
        table["matmul_flops"], (table["matmul_rate_1"], table["matmul_rate_n"]) = matmul_rates(repeats, call, threads)
        table["elementwise_bytes"], (table["elementwise_rate_1"], table["elementwise_rate_n"]) = \
            elementwise_rates(repeats, call, threads)
        for kind in ("matmul", "elementwise"):  # a disturbed sample at n threads cannot be slower than one thread
            table[f"{kind}_rate_n"] = [max(n, one) for n, one in zip(table[f"{kind}_rate_n"], table[f"{kind}_rate_1"])]
        for suffix, k in zip(("1", "n"), threads):
            torch.set_num_threads(k)
            table[f"attention_fwd_{suffix}"], table[f"attention_bwd_{suffix}"] = attention_rates(repeats)
    finally:
        torch.set_num_threads(saved)
    return table


def cpu_table_toml(table: dict) -> list[str]:
    """The [cpu] table as TOML lines."""
    lines = ["[cpu]"]
    for key, value in table.items():
        if isinstance(value, (list, tuple)):
            lines.append(f"{key} = [{', '.join(f'{v:.6g}' for v in value)}]")
        else:
            lines.append(f"{key} = {value:.6g}" if isinstance(value, float) else f"{key} = {value}")
    return lines
