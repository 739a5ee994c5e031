"""Layout parity on NCCL: the layouts of fourfold.testing.LAYOUTS that fit the GPUs, each against one GPU.

    python bench/nccl_parity.py                       # every 2-rank layout of the table
    python bench/nccl_parity.py --gpus 4 --layouts fsdp4,tp4-kv-split
    python bench/nccl_parity.py --device cpu --layouts dp2     # a dry run of the script itself, on gloo
    python bench/nccl_parity.py --data examples/chat_tiny.jsonl    # chat data: the masked loss on every layout

The CPU test suite (tests/distributed/test_layouts.py) checks every row of the same table on gloo; this
runs the rows through NCCL on real GPUs: each layout trains a small model in float64 for PARITY_STEPS
steps with `fourfold train` under torchrun, and its losses and final weights are compared with the
one-GPU run of the same config (and the same model overrides). It prints the largest differences and
whether they are within the table's PARITY_TOLERANCE.
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

from fourfold.testing import LAYOUTS, PARITY_OVERRIDES, PARITY_TOLERANCE, ParityLayout, final_weights, losses, \
    model_overrides  # noqa: E402

# A larger model than the gloo tests' (GPUs are fast); the table's overrides go on top.
BASE = ParityLayout(1, {
    "model.dim": 64, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_dim": 128,
    "model.max_seq_len": 128, "train.seq_len": 64, "train.global_batch": 8, "train.micro_batch": 2,
    "train.val_every": 0, "log.every": 1, "log.progress": False,
    "data.max_bytes": 300000, **PARITY_OVERRIDES}).cli_args()


def within(diff: float, ref: float, kind: str) -> bool:
    """Whether an absolute difference from `ref` is inside the table's (rtol, atol) for `kind`."""
    rtol, atol = PARITY_TOLERANCE[kind]
    return diff <= atol + rtol * abs(ref)


def main() -> None:
    """Train each chosen layout on its GPUs and print its largest loss and weight differences from one GPU."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2, help="run the table's layouts of this many ranks")
    p.add_argument("--layouts", default="", help="comma-separated names from fourfold.testing.LAYOUTS")
    p.add_argument("--device", default="cuda", help="cuda (NCCL), or cpu (gloo) to try the script without GPUs")
    p.add_argument("--data", default="", help="train on this data.path (e.g. a chat .jsonl) instead of the stdlib")
    args = p.parse_args()
    names = args.layouts.split(",") if args.layouts else [n for n, lay in LAYOUTS.items() if lay.ranks == args.gpus]
    tmp = Path(tempfile.mkdtemp())
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "PYTHONPATH": ROOT}
    common = [*BASE, "--compute.device", args.device, "--data.cache_dir", str(tmp / "cache")]
    if args.data:
        common += ["--data.path", args.data, "--train.seq_len", "128"]
    references: dict[tuple, tuple] = {}
    print(f"{'layout':22s} {'max |loss diff|':>16s} {'max |weight diff|':>18s}  within tolerance")
    for name in names:
        layout = LAYOUTS[name]
        model = ParityLayout(1, model_overrides(layout.overrides)).cli_args()
        key = tuple(model)
        if key not in references:
            ref_dir = tmp / f"single-{len(references)}"
            cmd = [sys.executable, "-m", "fourfold", "train", *common, *model, "--sample", "", "--out", str(ref_dir)]
            subprocess.run(cmd, check=True, env=env, capture_output=True)
            references[key] = (losses(ref_dir), final_weights(ref_dir))
        ref_l, ref_w = references[key]
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={layout.ranks}",
               "-m", "fourfold", "train", *common, *layout.cli_args(), "--out", str(tmp / name)]
        proc = subprocess.run(run, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(f"{name:22s} FAILED\n{proc.stderr[-1500:]}")
            continue
        got_l, got_w = losses(tmp / name), final_weights(tmp / name)
        loss_ok = len(got_l) == len(ref_l) and all(within(abs(a - b), b, "loss") for a, b in zip(got_l, ref_l))
        dl = max(abs(a - b) for a, b in zip(got_l, ref_l))
        dw = {k: (got_w[k] - ref_w[k]).abs() for k in ref_w}
        rtol, atol = PARITY_TOLERANCE["weight"]
        weight_ok = got_w.keys() == ref_w.keys() and all(bool((d <= atol + rtol * ref_w[k].abs()).all())
                                                         for k, d in dw.items())
        print(f"{name:22s} {dl:16.3e} {max(float(d.max()) for d in dw.values()):18.3e}  "
              f"{'yes' if loss_ok and weight_ok else 'NO'}")


if __name__ == "__main__":
    main()
