"""CPU cost constants as data: fixed per-op costs, matmul / element-wise / attention rates by size, gloo's alpha-beta.

    costs = cpu_costs_from(table, where="calibration.toml: cpu")    # the [cpu] table of a hardware file
    costs.matmul_seconds(2 * 1024 * 256 * 768, threads=1)           # one GEMM of that many FLOPs
    costs.collective_seconds("all_gather", nbytes, ranks=2)

On a CPU a small model's step is not FLOPs at peak: every dispatched op costs a fixed few microseconds
(Python, the dispatcher, autograd), small GEMMs run far below the large-GEMM rate, element-wise ops are
bounded by cache and memory bandwidth, and each gloo collective pays a latency before its bytes move. These
figures are measured by `fourfold plan calibrate` (fourfold/plan/calibrate_cpu.py, micro-benchmarks only)
and read by fourfold/plan/cpu_steptime.py. Rates are tabulated against the size of one call (FLOPs for
GEMMs, bytes for element-wise ops) at one thread and at every core, and interpolated log-log.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, fields

from fourfold.errors import ConfigError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")
"""gloo operations with a measured latency and bandwidth (bytes: the whole tensor; p2p: the bytes sent)."""


@dataclass(frozen=True)
class CpuCosts:
    """Measured CPU costs (seconds, FLOP/s, bytes/s); see `fourfold plan calibrate`."""

    cores: int
    """CPU cores the rates at `*_n` were measured with (torch's intra-op threads of a one-process run)."""
    op_overhead: float
    """Seconds per dispatched aten op with data (Python or the autograd engine, dispatcher, kernel launch)."""
    view_overhead: float
    """Seconds per dispatched op that moves no data (views, detach, scalar reads)."""
    foreach_tensor: float
    """Seconds per tensor inside one foreach op (the CPU runs a foreach op tensor by tensor)."""
    matmul_flops: tuple[float, ...]
    """FLOPs of one GEMM call at which the matmul rates were measured (increasing)."""
    matmul_rate_1: tuple[float, ...]
    """FLOP/s of an fp32 GEMM of that size on one thread, its fixed op cost taken out."""
    matmul_rate_n: tuple[float, ...]
    """Same on `cores` threads."""
    elementwise_bytes: tuple[float, ...]
    """Bytes (inputs + output) of one element-wise call at which its rates were measured (increasing)."""
    elementwise_rate_1: tuple[float, ...]
    """Bytes/s of such a call on one thread, its fixed op cost taken out."""
    elementwise_rate_n: tuple[float, ...]
    """Same on `cores` threads."""
    attention_fwd_1: float
    """Causal attention forward (CPU flash kernel), causal FLOPs/s on one thread."""
    attention_bwd_1: float
    """Its backward, the same FLOP count per second on one thread."""
    attention_fwd_n: float
    """Forward on `cores` threads."""
    attention_bwd_n: float
    """Backward on `cores` threads."""
    latency: tuple[float, ...]
    """gloo seconds per call of each of COLLECTIVES between two local processes (a tiny message)."""
    bandwidth: tuple[float, ...]
    """gloo bytes/s of each of COLLECTIVES (bytes as in COLLECTIVES) between two local processes."""
    tp_linear: float
    """Seconds a tensor-parallel (DTensor) linear adds to one forward + backward over a plain one, no collective."""
    fsdp_unit: float
    """Seconds one FSDP2 unit adds per forward + backward of one micro-batch (hooks, copy-in/out, the
    collectives' latency) on two ranks, over the same layers unsharded; bytes are charged apart. Used only where
    the layout's own model cannot be traced (inside a distributed run)."""
    comm_factor: float
    """A collective inside a step over the same call back to back (the median after a few milliseconds of compute
    on both ranks over the fastest of repeated calls): what `latency` and `bandwidth` are multiplied by."""
    dtensor_op: float
    """Seconds one DTensor op adds to its local kernel (sharding propagation, unwrapping and wrapping), from a
    tensor-parallel reference step (fourfold/plan/calibrate_reference.py)."""
    fsdp_hook: float
    """Seconds one FSDP2 unit adds per micro-batch on the CPU (its pre/post forward and backward hooks), its copies
    and collectives priced apart, from an FSDP2 reference step."""
    step_factor_1: float
    """A reference step's measured time over the price of its traced ops at the tables' rates, on one thread
    (cold operands, page faults, autograd and Python between the ops: what isolated micro-benchmarks miss)."""
    step_factor_n: float
    """Same on `cores` threads."""

    def step_factor(self, threads: int) -> float:
        """What the op prices are multiplied by on `threads` threads (1, or `cores`)."""
        return self.step_factor_n if threads > 1 else self.step_factor_1

    def matmul_seconds(self, flops: float, threads: int) -> float:
        """One GEMM of `flops` FLOPs on `threads` threads (1, or `cores`)."""
        rates = self.matmul_rate_n if threads > 1 else self.matmul_rate_1
        return self.op_overhead + flops / interpolate(self.matmul_flops, rates, flops)

    def elementwise_seconds(self, nbytes: float, threads: int, calls: int = 1) -> float:
        """`calls` element-wise calls moving `nbytes` bytes in all."""
        rates = self.elementwise_rate_n if threads > 1 else self.elementwise_rate_1
        per_call = nbytes / max(1, calls)
        return self.op_overhead * calls + (nbytes / interpolate(self.elementwise_bytes, rates, per_call) if nbytes else 0.0)

    def attention_seconds(self, causal_flops: float, backward: bool, threads: int) -> float:
        """The CPU flash-attention kernel over `causal_flops` (4 b h s_q s_k d / 2 for causal)."""
        if threads > 1:
            rate = self.attention_bwd_n if backward else self.attention_fwd_n
        else:
            rate = self.attention_bwd_1 if backward else self.attention_fwd_1
        return self.op_overhead + causal_flops / rate

    def collective_seconds(self, kind: str, nbytes: float, ranks: int, latency: bool = True) -> float:
        """One gloo `kind` over `ranks` processes; latency and bytes scaled from the measured two-rank figures
        as a ring does it (ranks - 1 steps; all-reduce twice the bytes of a gather). `latency` False: the
        bytes' time only (where a measured fixed cost already holds the latency)."""
        if ranks <= 1:
            return 0.0
        i = COLLECTIVES.index(kind)
        steps = ranks - 1 if kind != "p2p" else 1
        share = 2 * (ranks - 1) / ranks if kind == "all_reduce" else ((ranks - 1) / ranks if kind != "p2p" else 1.0)
        two_rank_share = 1.0 if kind == "all_reduce" else (0.5 if kind != "p2p" else 1.0)
        return self.comm_factor * (self.latency[i] * steps * latency +
                                   nbytes * share / two_rank_share / self.bandwidth[i])


def interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """ys at x, piecewise linear in log-log between the points, held constant outside them."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    j = bisect.bisect_right(xs, x)
    t = (math.log(x) - math.log(xs[j - 1])) / (math.log(xs[j]) - math.log(xs[j - 1]))
    return math.exp(math.log(ys[j - 1]) + t * (math.log(ys[j]) - math.log(ys[j - 1])))


TABLES = {"matmul_flops": ("matmul_rate_1", "matmul_rate_n"),
          "elementwise_bytes": ("elementwise_rate_1", "elementwise_rate_n"), "": ("latency", "bandwidth")}


def check_cpu_table(raw: dict, where: str) -> dict:
    """`raw` (a [cpu] table, whole or in part) with every value checked; a ConfigError names a bad one."""
    names = {f.name: f.type for f in fields(CpuCosts)}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table of key = value lines.")
    out = {}
    for key, value in raw.items():
        if key not in names:
            raise ConfigError(f"{where}: unknown key '{key}'. Keys: {', '.join(names)}.")
        values = value if isinstance(value, list) else [value]
        if "tuple" in str(names[key]) and not isinstance(value, list):
            raise ConfigError(f"{where}: '{key}' must be a list of numbers, not {value!r}.")
        if "tuple" not in str(names[key]) and isinstance(value, list):
            raise ConfigError(f"{where}: '{key}' must be one number, not a list ({value!r}).")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{where}: '{key}' = {value!r}: every value must be a positive number (seconds, "
                                  "FLOP/s, bytes/s or a size); run `fourfold plan calibrate` again or fix it.")
        out[key] = tuple(float(v) for v in value) if isinstance(value, list) else float(value)
    if "cores" in out:
        out["cores"] = int(out["cores"])
    return out


def cpu_costs_from(table: dict, where: str) -> CpuCosts | None:
    """The CpuCosts of a merged [cpu] table (None when there is none); a missing key or a table of the wrong
    length is a ConfigError."""
    if not table:
        return None
    missing = [f.name for f in fields(CpuCosts) if f.name not in table]
    if missing:
        raise ConfigError(f"{where} misses {', '.join(missing)}; run `fourfold plan calibrate` to write every key.")
    for size_key, (a, b) in TABLES.items():
        n = len(table[size_key]) if size_key else len(COLLECTIVES)
        if size_key and list(table[size_key]) != sorted(set(table[size_key])):
            raise ConfigError(f"{where}: '{size_key}' must increase strictly.")
        for key in (a, b):
            if len(table[key]) != n:
                raise ConfigError(f"{where}: '{key}' has {len(table[key])} values, needs {n} "
                                  f"({'one per ' + size_key if size_key else ', '.join(COLLECTIVES)}).")
    return CpuCosts(**table)
