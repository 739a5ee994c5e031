"""CPU (gloo) measurements for the planner's validation: step time and peak tensor memory of layouts of the test table.

    python bench/planner_cpu.py [--out DIR] [--repeats N] [--steps 6]    # about 3 minutes on an idle 2-core machine

First `fourfold plan calibrate --device cpu` runs (its micro-benchmarks only: per-op costs, GEMM and
element-wise rates by size, attention, gloo latency and bandwidth per collective, DTensor and FSDP2 costs) and
writes cpu_calibration.toml next to the results; then each layout of fourfold/testing/layouts.py named in
LAYOUTS (and one process) trains a small fp32 model (dim 256, 4 blocks, 4 x 256 tokens per rank) under
torchrun on gloo, timing the real `Trainer.train_step` between barriers. The machine may be shared: a step
counts as undisturbed when the other processes used at most 10% of the cores meanwhile (/proc/stat less this
job's CPU time); each layout steps until `--steps` undisturbed steps ran (or 60 s passed) and reports the
fastest undisturbed step (quiet_steps 0: none was, and the row is marked disturbed); step_ms_less_runqueue
is an estimate for a disturbed machine: each step less the longest time a rank's main thread waited,
runnable, for a CPU (/proc/thread-self/schedstat), the fastest of them. Peak memory is the
most bytes of live CPU tensors over construction and two steps, from the profiler's allocation events (the
CPU's max_memory_allocated; the process's resident set would add the interpreter and torch). With
--repeats N the calibration and the runs are repeated N times into planner_cpu_K.json / cpu_calibration_K.toml.
planner_validation.py predicts each row with the calibration measured in its window; the share of the cores
other processes used during the calibration is recorded (calibration_others_share), and rows of a calibration
taken while others used more than QUIET of the machine count as disturbed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import report, run_variant_process  # noqa: E402

LAYOUTS = ["dp2", "fsdp2", "zero1-2", "tp2-sp", "cp2", "pp2-1f1b"]
MODEL = {"model.dim": 256, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_dim": 768,
         "model.vocab_size": 512, "model.max_seq_len": 256, "train.seq_len": 256, "train.micro_batch": 4,
         "compute.precision": "fp32", "compute.device": "cpu", "data.max_bytes": 2000000}


def layout_config(name: str) -> tuple[dict, int]:
    """(the flat config of layout `name`, its ranks); 1-rank baseline for name '1'."""
    from fourfold.testing.layouts import LAYOUTS as TABLE

    layout = TABLE[name] if name != "1" else None
    ranks = layout.ranks if layout else 1
    overrides = dict(layout.overrides) if layout else {}
    data = 1
    for key in ("parallel.dp", "parallel.fsdp"):
        data *= int(overrides.get(key, 1))
    pp = int(overrides.get("parallel.pp", 1))
    flat = {**MODEL, **{k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in overrides.items()},
            "train.global_batch": str(4 * data * (2 if pp > 1 else 1))}
    return {k: str(v) for k, v in flat.items()}, ranks


def live_tensor_peak(prof) -> int:
    """The most bytes CPU tensors held at once while `prof` (profile_memory=True) ran, counted from the first
    allocation it saw: the CPU allocator's equivalent of CUDA's max_memory_allocated."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


QUIET = 0.10
"""A step counts as undisturbed when other processes used at most this share of the machine's cores during it."""


def busy_seconds() -> float:
    """CPU seconds every process on this machine has used since boot (/proc/stat; 0 where it does not exist)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    """CPU seconds this process and its finished children (the calibration's gloo workers) have used."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def runqueue_wait() -> float:
    """Seconds this process's main thread has waited, runnable, for a CPU (/proc/thread-self/schedstat; 0 where
    it does not exist)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except OSError:
        return 0.0


def timed_step(trainer) -> tuple[float, float, float]:
    """(wall seconds of one trainer step between barriers, the share of the cores other processes used meanwhile:
    the machine's busy CPU time less what this job's ranks used, over wall time x cores, and the longest time
    the main thread of one rank waited for a CPU meanwhile)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    wait = runqueue_wait()
    busy, own, start = busy_seconds(), time.process_time(), time.perf_counter()
    trainer.train_step()
    if dist.is_initialized():
        dist.barrier()
    wall = time.perf_counter() - start
    used = torch.tensor([time.process_time() - own])
    waited = torch.tensor([runqueue_wait() - wait])
    if dist.is_initialized():
        dist.all_reduce(used)
        dist.all_reduce(waited, op=dist.ReduceOp.MAX)
    others = torch.tensor([max(0.0, busy_seconds() - busy - float(used)) / (wall * (os.cpu_count() or 1))])
    if dist.is_initialized():
        dist.broadcast(others, 0)
    return wall, float(others), float(waited)


def run_one(name: str, steps: int, budget: float = 60.0) -> None:
    """On this rank (under torchrun): build the trainer and take two steps under the memory profiler (the peak
    of live tensor bytes: parameters, gradients, optimizer state, activations), then timed steps, each between
    barriers, until `steps` of them ran undisturbed (other processes used at most QUIET of the cores) or
    `budget` seconds passed; rank 0 reports the fastest and the median undisturbed step (of all steps when
    none was) and the largest peak over ranks."""
    import statistics
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from fourfold.config import build_config
    from fourfold.train.trainer import Trainer

    flat, ranks = layout_config(name)
    cfg = build_config({}, {**flat, "train.val_every": "0", "checkpoint.every": "0",
                            "checkpoint.save_final": "false", "log.progress": "false"})
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = Trainer(cfg, tempfile.mkdtemp(prefix="planner-cpu-"))
        trainer.train_step()  # AdamW creates its state in the first step: the second holds it throughout
        trainer.train_step()
    peak = torch.tensor(float(live_tensor_peak(prof)))
    times, quiet, corrected = [], [], []
    deadline = time.perf_counter() + budget
    while True:  # rank 0 decides, so that every rank takes the same number of steps
        go = torch.tensor([float(len(quiet) < steps and (time.perf_counter() < deadline or len(times) < steps))])
        if dist.is_initialized():
            dist.broadcast(go, 0)
        if not go.item():
            break
        wall, others, waited = timed_step(trainer)
        times.append(wall)
        corrected.append(max(0.0, wall - waited))
        if others <= QUIET:
            quiet.append(wall)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    best = quiet or times
    report({"name": name, "world": ranks, "config": flat, "step_ms": 1000 * min(best),
            "step_ms_median": 1000 * statistics.median(best), "quiet_steps": len(quiet),
            "step_ms_less_runqueue": 1000 * min(corrected),
            "step_ms_all": [1000 * t for t in times],
            "peak_gib": float(peak) / 2**30, "threads": torch.get_num_threads()})


def main() -> None:
    """Calibrate, then time each layout in its own torchrun; write planner_cpu.json and cpu_calibration.toml."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(HERE, "results", f"{datetime.date.today()}-cpu-planner"))
    p.add_argument("--layouts", default=",".join(["1"] + LAYOUTS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=1, help="calibrate and measure every layout this many times")
    p.add_argument("--quick", action="store_true", help="the quick calibration")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        return run_one(args.one, args.steps)
    from fourfold.plan.calibrate import measure, write_calibration
    from pathlib import Path

    os.makedirs(args.out, exist_ok=True)
    for repeat in range(args.repeats):
        suffix = f"_{repeat + 1}" if args.repeats > 1 else ""
        start, busy, own = time.perf_counter(), busy_seconds(), _own_cpu_seconds()
        write_calibration(measure("cpu", quick=args.quick), Path(args.out) / f"cpu_calibration{suffix}.toml")
        wall = time.perf_counter() - start
        others = max(0.0, busy_seconds() - busy - (_own_cpu_seconds() - own)) / (wall * (os.cpu_count() or 1))
        print(f"calibrated in {wall:.0f} s; other processes used {others:.0%} of the cores meanwhile", flush=True)
        rows = []
        for name in args.layouts.split(","):
            _, ranks = layout_config(name)
            row = run_variant_process(__file__, name, ranks, ["--steps", str(args.steps)], timeout=600)
            print({k: v for k, v in row.items() if k != "config"}, flush=True)
            if "error" not in row:
                rows.append(row)
        with open(os.path.join(args.out, f"planner_cpu{suffix}.json"), "w") as f:
            json.dump({"args": vars(args), "calibration": f"cpu_calibration{suffix}.toml",
                       "calibration_others_share": others, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
