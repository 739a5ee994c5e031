"""Layout parity on NCCL: each layout trains the tiny model in float64 on 2 GPUs and is compared with 1 GPU.

    python bench/nccl_parity.py --layouts dp2,fsdp2,tp2,cp2,pp2

The CPU test suite checks every layout on gloo; this runs the same comparison through NCCL on real GPUs
(losses over 5 steps and final weights, float64), and prints the largest differences.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT]

LAYOUTS = {
    "dp2": ["--parallel.dp", "2"], "fsdp2": ["--parallel.fsdp", "2"], "zero1": ["--parallel.fsdp", "2", "--parallel.zero", "1"],
    "tp2": ["--parallel.tp", "2"], "tp2-nosp": ["--parallel.tp", "2", "--parallel.sequence_parallel", "false"],
    "cp2": ["--parallel.cp", "2"], "pp2": ["--parallel.pp", "2"],
    "pp2-zb": ["--parallel.pp", "2", "--parallel.pp_schedule", "zero-bubble"],
}
BASE = ["--model.dim", "64", "--model.n_layers", "4", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_dim", "128", "--model.max_seq_len", "128", "--train.seq_len", "64", "--train.steps", "5",
        "--train.global_batch", "8", "--train.micro_batch", "2", "--compute.precision", "fp64", "--compute.device", "cuda",
        "--train.val_every", "0", "--log.every", "1", "--log.progress", "false", "--data.max_bytes", "300000"]


def main() -> None:
    """Train each layout on 2 GPUs and print its largest loss and weight differences from 1 GPU."""
    from tests.trainer_helpers import final_weights, losses

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "fourfold", "train", *BASE, "--data.cache_dir", str(tmp / "cache"), "--sample", ""]
    subprocess.run([*cmd, "--out", str(tmp / "single")], check=True, env=env, capture_output=True)
    ref_l, ref_w = losses(tmp / "single"), final_weights(tmp / "single")
    print(f"{'layout':8s} {'max |loss diff|':>16s} {'max |weight diff|':>18s}")
    for name in args.layouts.split(","):
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "fourfold",
               "train", *BASE, *LAYOUTS[name], "--data.cache_dir", str(tmp / "cache"), "--out", str(tmp / name)]
        proc = subprocess.run(run, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(f"{name:8s} FAILED\n{proc.stderr[-1500:]}")
            continue
        got_l, got_w = losses(tmp / name), final_weights(tmp / name)
        dl = max(abs(a - b) for a, b in zip(got_l, ref_l))
        dw = max(float((got_w[k] - ref_w[k]).abs().max()) for k in ref_w)
        print(f"{name:8s} {dl:16.3e} {dw:18.3e}")


if __name__ == "__main__":
    main()
