"""Tensor/sequence and context parallelism on 2 GPUs: tp=2 (+SP) vs fsdp=2, and long context with cp=2.

    python bench/train_tp_cp.py --preset llama-1b --out train_tp_cp.json

Part 1, same batch (micro-batch 4 x seq 2048 per data rank, bf16): fsdp=2 vs tp=2 with sequence parallel
(tp ranks share one micro-batch, so the global batch is half): tokens/s per GPU and peak memory.
Part 2, one long sequence per step (full recompute, bf16): cp=2 (each GPU holds half of every sequence,
ring attention) vs no context parallel (fsdp=2, each GPU a whole sequence), at each length in --long-seqs;
a run that does not fit is reported as out of memory.
"""

from __future__ import annotations

import argparse
import os
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [BENCH, os.path.dirname(BENCH)]
from common import figures, fourfold_step, print_table, report, run_variant_process, save, time_steps  # noqa: E402


def variants(long_seqs: list[int], micro_batch: int, seq: int) -> dict:
    """Variant name -> (config overrides, micro-batch, sequence length, global batch), for both parts."""
    out = {
        f"fsdp2-s{seq}": ({"parallel.fsdp": 2}, micro_batch, seq, 2 * micro_batch),
        f"tp2-sp-s{seq}": ({"parallel.tp": 2}, micro_batch, seq, micro_batch),
        f"tp2-nosp-s{seq}": ({"parallel.tp": 2, "parallel.sequence_parallel": False}, micro_batch, seq, micro_batch),
    }
    for s in long_seqs:
        common = {"compute.recompute": "full", "model.max_seq_len": s}
        out[f"fsdp2-s{s}"] = ({**common, "parallel.fsdp": 2}, 1, s, 2)
        out[f"cp2-ring-s{s}"] = ({**common, "parallel.cp": 2}, 1, s, 1)
        out[f"cp2-allgather-s{s}"] = ({**common, "parallel.cp": 2, "parallel.cp_method": "allgather"}, 1, s, 1)
    return out


def run_one(name: str, args) -> None:
    """Time one variant on this rank (under torchrun) and report its row, or an out-of-memory error."""
    import torch

    overrides, mb, seq, global_batch = variants(args.long, args.micro_batch, args.seq)[name]
    try:
        step, cfg, _ = fourfold_step(args.preset, mb, seq, {**overrides, "compute.compile": str(args.compile).lower()},
                                     global_batch=global_batch)
        sec, loss = time_steps(step, args.warmup, args.steps)
    except torch.OutOfMemoryError:
        report({"variant": name, "gpus": 2, "error": "out of memory"})
        return
    report(figures(name, cfg.model, seq, global_batch * seq, sec, loss, 2))


def main() -> None:
    """Run each variant on 2 GPUs in its own process (or only --one), print the table against peers, save JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--long-seqs", default="16384,32768")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--variants", default="", help="comma-separated names to run (default: all)")
    p.add_argument("--out", default="train_tp_cp.json")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.long = [int(x) for x in args.long_seqs.split(",") if x]
    if args.one:
        return run_one(args.one, args)
    common = ["--preset", args.preset, "--micro-batch", str(args.micro_batch), "--seq", str(args.seq),
              "--long-seqs", args.long_seqs, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    common += ["--compile"] if args.compile else []
    rows = []
    chosen = [n for n in variants(args.long, args.micro_batch, args.seq) if not args.variants or n in args.variants.split(",")]
    for name in chosen:
        rows.append(run_variant_process(__file__, name, 2, common))
        print(rows[-1], flush=True)
    peers = {f"tp2-sp-s{args.seq}": f"fsdp2-s{args.seq}", f"tp2-nosp-s{args.seq}": f"fsdp2-s{args.seq}"}
    peers.update({f"cp2-{m}-s{s}": f"fsdp2-s{s}" for s in args.long for m in ("ring", "allgather")})
    print_table(rows, peers)
    save(args.out, args, rows)


if __name__ == "__main__":
    main()
