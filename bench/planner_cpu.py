"""CPU (gloo) measurements for the planner's validation: step time of a few layouts of the test table.

    python bench/planner_cpu.py [--out bench/results/<date>-cpu-planner]     # a few minutes on 2 cores

First `fourfold plan calibrate --device cpu` figures for this machine (matmul rate, copy bandwidth, gloo
all-reduce) are measured and written next to the results (cpu_calibration.toml); then each layout of
fourfold/testing/layouts.py named in LAYOUTS trains a small fp32 model (dim 256, 4 blocks, 4 x 256 tokens per
rank) for a few steps under torchrun on gloo, timing the real `Trainer.train_step`. planner_validation.py
reads planner_cpu.json and predicts each row on the calibrated "cpu" device. Peak memory is not compared
on CPUs (the process's resident set holds the interpreter and torch, which the model does not count; the
CPU memory formulas are checked exactly by tests/test_memory.py instead).
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


def run_one(name: str, steps: int) -> None:
    """On this rank (under torchrun): build the trainer and take one step under the memory profiler (the peak
    of live tensor bytes: parameters, gradients, optimizer state, activations), then one more warm-up step
    and `steps` timed steps, each between barriers; rank 0 reports the fastest and the median step and the
    largest peak over ranks."""
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
        trainer.train_step()
    peak = torch.tensor(float(live_tensor_peak(prof)))
    trainer.train_step()
    times = []
    for _ in range(steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        trainer.train_step()
        if dist.is_initialized():
            dist.barrier()
        times.append(time.perf_counter() - start)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    report({"name": name, "world": ranks, "config": flat, "step_ms": 1000 * min(times),
            "step_ms_median": 1000 * statistics.median(times), "step_ms_all": [1000 * t for t in times],
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
        start = time.perf_counter()
        write_calibration(measure("cpu", quick=args.quick), Path(args.out) / f"cpu_calibration{suffix}.toml")
        print(f"calibrated in {time.perf_counter() - start:.0f} s", flush=True)
        rows = []
        for name in args.layouts.split(","):
            _, ranks = layout_config(name)
            row = run_variant_process(__file__, name, ranks, ["--steps", str(args.steps)], timeout=600)
            print({k: v for k, v in row.items() if k != "config"}, flush=True)
            if "error" not in row:
                rows.append(row)
        with open(os.path.join(args.out, f"planner_cpu{suffix}.json"), "w") as f:
            json.dump({"args": vars(args), "calibration": f"cpu_calibration{suffix}.toml", "results": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
