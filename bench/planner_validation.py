"""The planner against every recorded run: predicted vs measured step time and peak memory, into docs/planner.md.

    python bench/planner_validation.py                 # print the table; rewrite docs/planner.md's table
    python bench/planner_validation.py --no-write      # print only

Reads the raw results under bench/results/ (the JSON each bench script wrote), rebuilds each run's config
from the bench script's own variant table (train_single.VARIANTS, train_dp.fourfold_layout,
train_tp_cp.variants, bench/pipeline.py's overrides), asks `fourfold.plan` for its step time and peak
memory on the recorded GPU, and writes one row per run with the error, the mean absolute errors and which
goals are met, between the VALIDATION markers of docs/planner.md. CPU (gloo) rows come from
bench/planner_cpu.py's results when present. No GPU is needed.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import write_doc_block  # noqa: E402
from fourfold.config import build_config  # noqa: E402
from fourfold.plan.hardware import load_hardware  # noqa: E402
from fourfold.plan.predict import predict  # noqa: E402

BEGIN, END = "<!-- VALIDATION BEGIN -->", "<!-- VALIDATION END -->"
GPU_NAMES = {"H200": "h200", "H100": "h100", "A100": "a100", "B200": "b200"}
# What a recorded run's code did differently from today's, per result directory: the ring-attention runs of
# session 3 used FlashAttention-2 blocks with K/V repeated per head (1.51x the whole-sequence kernel,
# bench/results/2026-11-23-h200-session4/ring_block_kernels.json); today's blocks are cuDNN (1.05x).
RUN_EFFICIENCY = {"2026-11-23-h200x2-session3": {"ring_attention": 1.51}}


@dataclass
class Run:
    """One recorded run: where it is from, its config and world, and what was measured."""

    source: str
    name: str
    cfg: object
    world: int
    device: str
    step_ms: float
    peak_gib: float | None
    optimizer_timed: bool = True
    hardware: tuple = ()
    """Extra hardware files for this run (the CPU calibration measured with it)."""
    disturbed: bool = False
    """A CPU run none of whose steps ran undisturbed by other processes, or whose calibration was disturbed (its
    time, or the costs it is predicted with, are not the machine's)."""


def _base(preset: str, mb: int, seq: int, world: int, overrides: dict, global_batch: int | None = None):
    flat = {"model.preset": preset, "train.seq_len": seq, "train.micro_batch": mb,
            "train.global_batch": global_batch or mb * world, "compute.precision": "bf16", "compute.device": "cuda"}
    flat.update(overrides)
    return build_config({}, {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in flat.items()})


def _device(row: dict, default: str = "h200") -> str:
    return next((v for k, v in GPU_NAMES.items() if k in row.get("gpu", "")), default)


def gpu_runs(results: str) -> list[Run]:
    """Every fourfold row of the recorded GPU results."""
    from train_dp import fourfold_layout
    from train_single import VARIANTS
    from train_tp_cp import variants as tp_cp_variants

    runs: list[Run] = []
    for path in sorted(glob.glob(os.path.join(results, "*", "*.json*"))):
        source = os.path.relpath(path, results)
        name = os.path.basename(path)
        if name.endswith(".jsonl"):
            rows = [json.loads(line) for line in open(path) if line.strip()]
            args = {"preset": "llama-1b", "micro_batch": 4, "seq": 2048, "long": [16384]}
        else:
            data = json.load(open(path))
            if not isinstance(data, dict) or "results" not in data or "args" not in data:
                continue  # not a training benchmark's result file
            rows, args = data["results"], data["args"]
        for row in rows:
            if "step_ms" not in row:
                continue
            variant = row.get("variant", "")
            if name.startswith("train_single") and variant in VARIANTS and variant.startswith("fourfold"):
                cfg = _base(args["preset"], args["micro_batch"], args["seq"], 1, VARIANTS[variant])
                runs.append(Run(source, variant, cfg, 1, _device(row), row["step_ms"], row.get("peak_mem_gib")))
            elif name.startswith("train_dp") and variant.startswith("fourfold"):
                world = row["gpus"]
                cfg = _base(args["preset"], args["micro_batch"], args["seq"], world,
                            fourfold_layout(variant, world) if world > 1 else {})
                runs.append(Run(source, variant, cfg, world, _device(row), row["step_ms"], row.get("peak_mem_gib")))
            elif name.startswith("train_tp_cp"):
                long = args.get("long") or [int(x) for x in str(args.get("long_seqs", "")).split(",") if x]
                table = tp_cp_variants(long, args["micro_batch"], args["seq"])
                if variant not in table:
                    continue
                overrides, mb, seq, gb = table[variant]
                cfg = _base(args["preset"], mb, seq, 2, {"compute.compile": False, **overrides}, gb)
                runs.append(Run(source, variant, cfg, 2, _device(row), row["step_ms"], row.get("peak_mem_gib")))
            elif name.startswith("pipeline") and "schedule" in row:
                vpp, m = row["vpp"], row["m"]
                overrides = {"parallel.pp": 2, "parallel.vpp": vpp, "parallel.pp_schedule": row["schedule"]}
                if vpp > 1:
                    overrides["parallel.pp_layers"] = "[6, 6, 5, 5]"
                cfg = _base(args["preset"], args["micro_batch"], args["seq"], 2, overrides, args["micro_batch"] * m)
                runs.append(Run(source, f"pp2 {row['schedule']} vpp{vpp} m{m}", cfg, 2, "h200", row["step_ms"],
                                None, optimizer_timed=False))
    return runs


def cpu_runs(results: str) -> list[Run]:
    """The CPU gloo rows bench/planner_cpu.py measured (with the calibration it measured first)."""
    runs = []
    for path in sorted(glob.glob(os.path.join(results, "*", "planner_cpu*.json"))):
        data = json.load(open(path))
        calibration = os.path.join(os.path.dirname(path), data.get("calibration", "cpu_calibration.toml"))
        calibration_disturbed = data.get("calibration_others_share", 0.0) > 0.10  # planner_cpu.QUIET
        for row in data["results"]:
            cfg = build_config({}, row["config"])
            runs.append(Run(os.path.relpath(path, results), row["name"], cfg, row["world"], "cpu", row["step_ms"],
                            row.get("peak_gib"), hardware=(calibration,),
                            disturbed=row.get("quiet_steps", 1) == 0 or calibration_disturbed))
    return runs


def evaluate(runs: list[Run], hardware_files: list[str]) -> list[dict]:
    """Predicted next to measured for each run."""
    out = []
    for run in runs:
        extra = {}
        for key, values in RUN_EFFICIENCY.items():
            if run.source.startswith(key):
                extra = values
        hw = load_hardware(list(hardware_files) + list(run.hardware), calibration=False, efficiency=extra)
        pred = predict(run.cfg, run.world, hw, run.device, gpus_per_node=8, optimizer=run.optimizer_timed)
        row = {"source": run.source, "name": run.name, "world": run.world, "device": run.device,
               "step_ms": run.step_ms, "pred_ms": 1000 * pred.step.seconds,
               "peak_gib": run.peak_gib, "pred_gib": pred.peak_bytes / 2**30, "disturbed": run.disturbed}
        row["time_err"] = (row["pred_ms"] - run.step_ms) / run.step_ms
        row["mem_err"] = (row["pred_gib"] - run.peak_gib) / run.peak_gib if run.peak_gib else None
        out.append(row)
    return out


def markdown(rows: list[dict]) -> str:
    """The table and the summary lines."""
    lines = ["| run (bench/results/…) | variant | GPUs | step ms measured | predicted | error | peak GiB measured "
             "| predicted | error |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        digits = 3 if r["device"] == "cpu" else 1
        mem = (f"{r['peak_gib']:.{digits}f} | {r['pred_gib']:.{digits}f} | {r['mem_err']:+.1%}"
               if r["mem_err"] is not None else f"— | {r['pred_gib']:.{digits}f} | —")
        mark = " (disturbed)" if r.get("disturbed") else ""
        lines.append(f"| {r['source']} | {r['name']}{mark} | {r['world']} × {r['device']} | {r['step_ms']:.1f} | "
                     f"{r['pred_ms']:.1f} | {r['time_err']:+.1%} | {mem} |")
    lines.append("")
    cpu = [r for r in rows if r["device"] == "cpu"]
    quiet = [abs(r["time_err"]) for r in cpu if not r.get("disturbed")]
    if quiet:
        lines.append(f"CPU (gloo) step time: mean absolute error **{sum(quiet) / len(quiet):.1%}** over {len(quiet)} "
                     f"undisturbed runs (goal 8%: {'met' if sum(quiet) / len(quiet) <= 0.08 else 'not met'}); "
                     f"worst {max(quiet):.1%}.")
    if len(quiet) < len(cpu):
        every = [abs(r["time_err"]) for r in cpu]
        lines.append(f"CPU rows marked disturbed ({len(cpu) - len(quiet)}): no step ran while other processes left "
                     f"the cores free, or the calibration ran while they did not; over all {len(cpu)} CPU rows the mean absolute error is {sum(every) / len(every):.1%}.")
    cpu_m = [abs(r["mem_err"]) for r in cpu if r["mem_err"] is not None]
    if cpu_m:
        lines.append(f"CPU peak memory (live tensor bytes): mean absolute error **{sum(cpu_m) / len(cpu_m):.1%}** over "
                     f"{len(cpu_m)} runs (goal 5%: {'met' if sum(cpu_m) / len(cpu_m) <= 0.05 else 'not met'}); "
                     f"worst {max(cpu_m):.1%}.")
    rows = [r for r in rows if r["device"] != "cpu"]
    t = [abs(r["time_err"]) for r in rows]
    m = [abs(r["mem_err"]) for r in rows if r["mem_err"] is not None]
    lines.append(f"GPU step time: mean absolute error **{sum(t) / len(t):.1%}** over {len(t)} runs (goal 8%: "
                 f"{'met' if sum(t) / len(t) <= 0.08 else 'not met'}); worst {max(t):.1%}.")
    if m:
        lines.append(f"GPU peak memory: mean absolute error **{sum(m) / len(m):.1%}** over {len(m)} runs (goal 5%: "
                     f"{'met' if sum(m) / len(m) <= 0.05 else 'not met'}); worst {max(m):.1%}; "
                     f"{sum(e <= 0.05 for e in m)} of {len(m)} rows within 5%.")
    return "\n".join(lines)


def first_picks(rows: list[dict], runs: list[Run], hardware_files: list[str]) -> str:
    """For 1 and 2 GPUs: the planner's ranking of the measured layouts against the measured ranking, and its
    own first pick over the whole search space at the benchmark shape."""
    from fourfold.plan.report import describe
    from fourfold.plan.search import rank_layouts

    hw = load_hardware(hardware_files, calibration=False)
    lines = ["| GPUs | fastest measured (tokens/s/GPU) | planner's pick among the measured | its measured speed "
             "| within 3%? | planner's pick over its whole space (predicted tokens/s/GPU) |",
             "|---:|---|---|---:|---|---|"]
    for world in (1, 2):
        pool = [(r, run) for r, run in zip(rows, runs) if run.world == world and run.optimizer_timed
                and run.cfg.train.seq_len == 2048 and run.cfg.model.preset == "llama-1b"
                and not run.source.startswith("2026-11-23-h200x2-session3/train_single")]  # older code
        speed = [(run.cfg.train.global_batch * run.cfg.train.seq_len / (r["step_ms"] / 1e3) / world, r, run)
                 for r, run in pool]
        best_measured = max(speed, key=lambda x: x[0])
        picked = min(speed, key=lambda x: (x[1]["pred_ms"] / x[2].cfg.train.global_batch, -x[0]))
        ok = picked[0] >= 0.97 * best_measured[0]
        base = _base("llama-1b", 4, 2048, world, {}, 4 * world)
        ranked, total, _ = rank_layouts(base, world, hw, "h200", 8, "ib400", top=1)
        top = ranked[0]
        lines.append(f"| {world} | {best_measured[2].name} ({best_measured[0]:,.0f}) | {picked[2].name} "
                     f"({picked[1]['source']}) | {picked[0]:,.0f} | {'yes' if ok else 'no'} | {describe(top.cfg)}, "
                     f"micro-batch {top.cfg.train.micro_batch}, recompute {top.cfg.compute.recompute}, "
                     f"float8 {top.cfg.quant.float8}, compile {top.cfg.compute.compile_scope if top.cfg.compute.compile else 'off'} "
                     f"({top.prediction.tokens_per_s_per_gpu:,.0f}; best of {total}) |")
    return "\n".join(lines)


def main() -> None:
    """Evaluate every recorded run, print the table, rewrite docs/planner.md's table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=os.path.join(HERE, "results"))
    p.add_argument("--doc", default=os.path.join(os.path.dirname(HERE), "docs", "planner.md"))
    p.add_argument("--hardware", action="append", default=[])
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--json", default="")
    args = p.parse_args()
    runs = gpu_runs(args.results) + cpu_runs(args.results)
    rows = evaluate(runs, args.hardware)
    text = markdown(rows) + "\n\nFirst picks (benchmark shape: llama-1b, seq 2048, 4 sequences per GPU, H200):\n\n" + \
        first_picks(rows, runs, args.hardware)
    print(text)
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)
    if not args.no_write:
        write_doc_block(args.doc, BEGIN, END, text)


if __name__ == "__main__":
    main()
