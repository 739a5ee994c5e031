"""Pipeline schedules on 2 GPUs: tokens/s and the measured bubble next to the formula, with timeline pictures.

    python bench/pipeline.py --preset llama-1b --micro-batch 2 --seq 2048 --micro-batches 4,8,16 --out-dir results/

Two torchrun runs of 2 ranks (pp=2): one builds the stages once and runs GPipe, 1F1B and zero-bubble
(ZB-H1) executors over them for each micro-batch count m; the other splits each rank into 2 virtual
stages and runs interleaved 1F1B. Each (schedule, m) is warmed up, then timed over several steps; the
bubble is the idle fraction of the stage timelines of the last step (CUDA events around every action),
next to the analytic value. Writes `pipeline.json` and, for m = 8, a Chrome trace and a PNG timeline per
schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [BENCH, os.path.dirname(BENCH)]
from common import fourfold_step, run_variant_process  # noqa: E402


def run_group(vpp: int, schedules: list[str], args) -> None:
    """Time `schedules` on pp=2 with `vpp` chunks per rank, at each micro-batch count (run under torchrun).

    Rank 0 prints each row, writes the m = 8 trace and timeline to --out-dir, and ends with a RESULT line.
    """
    import torch
    import torch.distributed as dist

    from fourfold.config import build_config
    from fourfold.hardware import peak_flops
    from fourfold.models.llama import training_flops_per_token
    from fourfold.parallel.pipeline import (PipelineExecutor, analytic_bubble, draw_timeline, pipeline_bubble,
                                            write_chrome_trace)

    overrides = {"parallel.pp": 2, "parallel.vpp": vpp,
                 "parallel.pp_schedule": "interleaved-1f1b" if vpp > 1 else "1f1b"}
    n_layers, stages = build_config({}, {"model.preset": args.preset}).model.n_layers, 2 * vpp
    if n_layers % stages:  # e.g. the 1.1B preset's 22 blocks over 4 chunks: 6, 6, 5, 5 (11 per rank)
        overrides["parallel.pp_layers"] = [n_layers // stages + (i < n_layers % stages) for i in range(stages)]
    _, cfg, trainer = fourfold_step(args.preset, args.micro_batch, args.seq, overrides,
                                    global_batch=args.micro_batch * 2)
    rank = dist.get_rank()
    vocab, rows = cfg.model.vocab_size, []
    gen = torch.Generator().manual_seed(0)
    flops, peak = training_flops_per_token(cfg.model, args.seq), peak_flops(trainer.device)
    for schedule in schedules:
        for m in [int(x) for x in args.micro_batches.split(",")]:
            if schedule == "interleaved-1f1b" and m % 2:
                continue
            runner = trainer.runner  # the trainer's own stages, loss and autocast, under other schedules
            ex = PipelineExecutor(runner.chunks, schedule, trainer.mesh.coord("pp"), 2, vpp, m,
                                  trainer.mesh.group("pp"), runner.loss_fn, trainer.device, torch.float32,
                                  autocast=runner.autocast,
                                  activation_shape=(args.micro_batch, args.seq, cfg.model.dim))
            batches = []
            for _ in range(m):
                ids = torch.randint(0, vocab, (args.micro_batch, args.seq + 1), generator=gen)
                batches.append((ids[:, :-1], ids[:, 1:]))
            for _ in range(args.warmup):
                ex.step(batches)
                trainer.optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                ex.step(batches)
                trainer.optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            sec = (time.perf_counter() - start) / args.steps
            timelines: list = [None] * dist.get_world_size()
            dist.all_gather_object(timelines, ex.last_timeline)
            if rank == 0:
                tps = m * args.micro_batch * args.seq / sec
                row = {"schedule": schedule, "vpp": vpp, "m": m, "step_ms": 1000 * sec, "tokens_per_s": tps,
                       "tokens_per_s_per_gpu": tps / 2, "mfu": flops * tps / (2 * peak) if peak else None,
                       "bubble_measured": pipeline_bubble(timelines),
                       "bubble_analytic": analytic_bubble(schedule, 2, vpp, m)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if m == 8 and args.out_dir:
                    stem = os.path.join(args.out_dir, f"pp-{schedule}-m8")
                    write_chrome_trace(timelines, stem + ".json")
                    try:
                        draw_timeline(timelines, stem + ".png", f"{schedule}, pp=2 vpp={vpp} m=8 (1.1B, H200)")
                    except ImportError as e:  # the trace still holds the timeline; draw it later from the JSON
                        print(f"no picture: {e}", flush=True)
    if rank == 0:
        print("RESULT " + json.dumps({"variant": f"vpp{vpp}", "rows": rows}), flush=True)


def main() -> None:
    """Run both schedule groups in torchrun subprocesses (or one with --one); print the table, write pipeline.json."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batches", default="2,4,8,16")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out-dir", default=".")
    p.add_argument("--groups", default="vpp1,vpp2", help="vpp1: GPipe, 1F1B, zero-bubble; vpp2: interleaved 1F1B")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    groups = {"vpp1": (1, ["gpipe", "1f1b", "zero-bubble"]), "vpp2": (2, ["interleaved-1f1b"])}
    if args.one:
        vpp, schedules = groups[args.one]
        return run_group(vpp, schedules, args)
    common = ["--preset", args.preset, "--micro-batch", str(args.micro_batch), "--seq", str(args.seq),
              "--micro-batches", args.micro_batches, "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--out-dir", args.out_dir]
    rows = []
    for name in args.groups.split(","):
        result = run_variant_process(__file__, name, 2, common, timeout=1200)
        if "error" in result:
            print(f"{name} FAILED: {result['error'][-1500:]}")
            continue
        rows.extend(result["rows"])
    print(f"\n{'schedule':18s} {'m':>3s} {'tok/s/gpu':>10s} {'MFU':>6s} {'bubble':>7s} {'formula':>8s} {'ratio':>6s}")
    for r in rows:
        ratio = r["bubble_measured"] / r["bubble_analytic"] if r["bubble_analytic"] else float("nan")
        print(f"{r['schedule']:18s} {r['m']:3d} {r['tokens_per_s_per_gpu']:10,.0f} {100 * (r['mfu'] or 0):5.1f}% "
              f"{100 * r['bubble_measured']:6.1f}% {100 * r['bubble_analytic']:7.1f}% {ratio:6.2f}")
    with open(os.path.join(args.out_dir, "pipeline.json"), "w") as f:
        json.dump({"args": vars(args), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
