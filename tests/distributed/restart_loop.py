"""Restart reliability loop, run by hand (not part of the suite): N jobs, each loses rank 1 and must finish.

    python -m tests.distributed.restart_loop --runs 20 [--nproc 2] [--tmp /tmp/restart-loop]
    python -m tests.distributed.restart_loop --runs 20 --bare [--no-prefix]

Default: N times `fourfold train --nproc 2 --max-restarts 1 --fault.kill_at_step 7 --fault.kill_rank 1`
on the tiny config (12 steps, a checkpoint every 4); a run passes when it exits 0 and its loss log equals
an uninterrupted run's exactly. `--bare` runs a torch-only job under `torchrun --max-restarts 1` whose
rank 1 dies after its first all-reduce, with the process group on the attempt-prefixed store fourfold
uses (fourfold.distributed.attempt_store), or, with `--no-prefix`, on torchrun's plain `env://` store: the
case that failed in gloo's connectFullMesh. Prints one line per run and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from fourfold.testing import TINY_MODEL, write_corpus

BARE_JOB = """
import os, sys, torch, torch.distributed as dist
from datetime import timedelta
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if sys.argv[1] == "prefix":
    from fourfold.distributed import attempt_store
    dist.init_process_group("gloo", store=attempt_store(rank, world, timedelta(seconds=60)), rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
else:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
dist.all_reduce(torch.ones(1))
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and rank == 1:
    os._exit(1)
dist.barrier()
dist.destroy_process_group()
"""


def tiny_flags(tmp: Path) -> list[str]:
    """The tiny config as command-line flags (12 steps, a checkpoint every 4)."""
    corpus = tmp / "corpus.txt"
    if not corpus.exists():
        write_corpus(corpus)
    flat = {"data.path": corpus, "data.cache_dir": tmp / "cache", "train.steps": 12, "train.global_batch": 8,
            "train.micro_batch": 2, "train.seq_len": 16, "optim.warmup_steps": 2, "train.val_every": 0,
            "compute.device": "cpu", "log.every": 1, "log.progress": "false", "checkpoint.every": 4,
            **{f"model.{k}": v for k, v in TINY_MODEL.items()}}
    return [x for k, v in flat.items() for x in (f"--{k}", str(v))]


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--tmp", default="/tmp/restart-loop")
    p.add_argument("--bare", action="store_true", help="torch-only job instead of fourfold train")
    p.add_argument("--no-prefix", action="store_true", help="with --bare: torchrun's plain env:// store")
    a = p.parse_args()
    tmp = Path(a.tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    train = [sys.executable, "-m", "fourfold", "train", "--nproc", str(a.nproc), "--sample", "",
             "--parallel.dp", str(a.nproc), *tiny_flags(tmp)]
    reference = None
    if not a.bare:
        subprocess.run([*train, "--out", str(tmp / "reference")], env=env, check=True, capture_output=True)
        reference = losses(tmp / "reference")
    passed = 0
    for i in range(a.runs):
        t0 = time.monotonic()
        if a.bare:
            cmd = ["timeout", "120", sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={a.nproc}", "--max-restarts=1", str(tmp / "bare.py"),
                   "plain" if a.no_prefix else "prefix"]
            (tmp / "bare.py").write_text(BARE_JOB)
        else:
            run = tmp / f"run{i}"
            subprocess.run(["rm", "-rf", str(run)])
            cmd = ["timeout", "300", *train, "--out", str(run), "--max-restarts", "1", "--fault.kill_at_step", "7",
                   "--fault.kill_rank", "1"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        text = out.stdout + out.stderr
        same = out.returncode == 0 and (a.bare or losses(run) == reference)
        ok = out.returncode == 0 and same
        passed += ok
        print(f"run {i + 1}: exit {out.returncode}, {'' if a.bare else 'losses identical, ' if same else 'losses differ, '}"
              f"connectFullMesh errors {text.count('connectFullMesh failed')}, "
              f"{time.monotonic() - t0:.0f} s -> {'ok' if ok else 'FAILED'}", flush=True)
    print(f"{passed} of {a.runs} restarted jobs finished correctly")
    return 0 if passed == a.runs else 1


if __name__ == "__main__":
    sys.exit(main())
