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


def run_one(name: str, steps: int) -> None:
    """Time `steps` trainer steps of layout `name` on this rank (under torchrun); rank 0 reports."""
    import tempfile

    import torch.distributed as dist

    from fourfold.config import build_config
    from fourfold.train.trainer import Trainer

    flat, ranks = layout_config(name)
    cfg = build_config({}, {**flat, "train.val_every": "0", "checkpoint.every": "0",
                            "checkpoint.save_final": "false", "log.progress": "false"})
    trainer = Trainer(cfg, tempfile.mkdtemp(prefix="planner-cpu-"))
    trainer.train_step()
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    if dist.is_initialized():
        dist.barrier()
    report({"name": name, "world": ranks, "config": flat, "step_ms": 1000 * (time.perf_counter() - start) / steps})


def main() -> None:
    """Calibrate, then time each layout in its own torchrun; write planner_cpu.json and cpu_calibration.toml."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(HERE, "results", f"{datetime.date.today()}-cpu-planner"))
    p.add_argument("--layouts", default=",".join(["1"] + LAYOUTS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        return run_one(args.one, args.steps)
    from fourfold.plan.calibrate import measure, write_calibration
    from pathlib import Path

    os.makedirs(args.out, exist_ok=True)
    figures = measure("cpu")
    write_calibration(figures, Path(args.out) / "cpu_calibration.toml")
    rows = []
    for name in args.layouts.split(","):
        _, ranks = layout_config(name)
        row = run_variant_process(__file__, name, ranks, ["--steps", str(args.steps)], timeout=600)
        print(row, flush=True)
        if "error" not in row:
            rows.append(row)
    with open(os.path.join(args.out, "planner_cpu.json"), "w") as f:
        json.dump({"args": vars(args), "calibration": "cpu_calibration.toml", "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
