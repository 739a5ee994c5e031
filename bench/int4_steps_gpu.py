"""Where an int4 engine's steps take their time, against bf16 or with one run-time weight copy (one GPU).

    python bench/int4_steps_gpu.py --out DIR [--concurrency 64] [--preset llama-1b] [--quant int4-g128]
                                   [--modes "three copies,one copy"]   # or e.g. "bf16,three copies"

For each mode (`MODES`: bf16 runs the unconverted checkpoint; "three copies" / "one copy" the converted one with
FOURFOLD_INT4_ONE_COPY=0 / =1; "mixed eager" without graphs for steps that mix prefill and decode; a process each,
on bench/generate.py's random-weight checkpoints and engine settings: 256 sequences, 4096-token steps) runs
`--concurrency` greedy requests (prompt 128, 256 new tokens) to the end after a warm-up, and records for every
engine step the token rows it ran (prefill and decode) and the GPU time of its model forward (CUDA events around
the runner's forward, synchronised per step, so no step overlaps the next here). Steps are grouped by kind
(decode at r rows; a step with prefill tokens, by its row count rounded to 512) with count, mean and total ms, and
the steps with prefill tokens are listed in order. Then two torch.profiler kernel summaries (bench/generate.py's
kernel_summary): five steady decode steps at the same concurrency, and a fresh batch's first steps up to its first
all-decode step (its prefill). Writes int4_steps.json, int4_steps.md and the kernel summaries (kernels_MODE.txt, prefill_MODE.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from collections import defaultdict
from pathlib import Path

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(BENCH), BENCH]

from common import run_variant_process  # noqa: E402

MODES = {"bf16": {}, "three copies": {"FOURFOLD_INT4_ONE_COPY": "0"}, "one copy": {"FOURFOLD_INT4_ONE_COPY": "1"},
         "bf16 mixed eager": {}, "three copies mixed eager": {"FOURFOLD_INT4_ONE_COPY": "0"}}
"""Mode name -> environment of its process; "bf16" modes run the checkpoint before conversion; "mixed eager" ones
replay prefill graphs only for steps of one sequence (EngineConfig.prefill_graph_seqs=1), as before mixed steps had
graphs of their own."""
PROMPT, NEW = 128, 256


def timed_steps(engine, prompts, params) -> list[dict]:
    """Runs `prompts` to the end; per step its chunks' rows and the forward's GPU milliseconds."""
    import torch

    runner, sched = engine.runner, engine.scheduler
    record: dict = {}
    schedule, forward, forward_greedy = sched.schedule, runner.forward, runner.forward_greedy

    def schedule_rows():
        chunks = schedule()
        record["decode"] = sum(1 for c in chunks if c.num_tokens == 1)
        record["rows"] = sum(c.num_tokens for c in chunks)
        return chunks

    def events_around(fn):
        def wrapped(st):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(st)
            end.record()
            record["events"] = (start, end)
            return out
        return wrapped

    sched.schedule, runner.forward, runner.forward_greedy = schedule_rows, events_around(forward), \
        events_around(forward_greedy)
    for i, p in enumerate(prompts):
        engine.add_request(f"steps-{i}", p, params)
    steps = []
    try:
        while engine.has_unfinished():
            record.clear()
            engine.step()
            torch.cuda.synchronize()
            if "events" in record:
                start, end = record["events"]
                steps.append({"rows": record["rows"], "decode": record["decode"], "ms": start.elapsed_time(end)})
    finally:
        sched.schedule, runner.forward, runner.forward_greedy = schedule, forward, forward_greedy
    return steps


def prefill_summary(engine, prompts, params, tag: str) -> str:
    """kernel_summary of a fresh batch's steps up to (not including) its first step of decode rows only: the
    prefill, mixed steps included; the requests then run to the end."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from generate import kernel_summary

    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    sched, kinds = engine.scheduler, []
    schedule = sched.schedule

    def schedule_kinds():
        chunks = schedule()
        kinds.append(all(c.num_tokens == 1 for c in chunks))
        return chunks

    sched.schedule = schedule_kinds
    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            while not kinds or not kinds[-1]:
                engine.step()
            torch.cuda.synchronize()
    finally:
        sched.schedule = schedule
    summary = kernel_summary(prof, 1)
    while engine.has_unfinished():
        engine.step()
    return f"{len(kinds) - 1} prefill steps and the first decode step, us are for all of them together\n" + summary


def group(steps: list[dict]) -> dict:
    """Steps by kind: 'decode r' (only decode rows) or 'prefill ~R' (rows rounded up to 512)."""
    out = defaultdict(lambda: {"count": 0, "ms": 0.0})
    for s in steps:
        kind = f"decode {s['rows']}" if s["rows"] == s["decode"] else f"prefill <= {-(-s['rows'] // 512) * 512}"
        out[kind]["count"] += 1
        out[kind]["ms"] += s["ms"]
    return dict(out)


def child(args) -> None:
    import torch

    from fourfold.infer.llm import LLM
    from fourfold.infer.requests import SamplingParams
    from fourfold.quant.packing import Int4WeightLinear
    from generate import model_dir, preset_vocab, prompts_for, steady_decode_summary

    ns = types.SimpleNamespace(preset=args.preset, device="cuda", workdir=args.workdir)
    quant = None if args.mode.startswith("bf16") else args.quant
    llm = LLM(model_dir(ns, quant), device="cuda", dtype=torch.bfloat16, max_num_seqs=256,
              max_num_batched_tokens=4096, prefill_graph_seqs=1 if args.mode.endswith("mixed eager") else 0)
    engine, vocab = llm.engine, preset_vocab(ns)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(prompts_for(args.concurrency, PROMPT, vocab, seed=1), params, progress=False)   # warm-up
    t0 = time.perf_counter()
    llm.generate(prompts_for(args.concurrency, PROMPT, vocab, seed=2), params, progress=False)
    wall = time.perf_counter() - t0
    steps = timed_steps(engine, prompts_for(args.concurrency, PROMPT, vocab, seed=3), params)
    summary = steady_decode_summary(engine, prompts_for(args.concurrency, PROMPT, vocab, seed=4),
                                    SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, detokenize=False),
                                    "profile")
    prefill = prefill_summary(engine, prompts_for(args.concurrency, PROMPT, vocab, seed=5), params, "prefill")
    words = sum(m.holds_words for m in engine.runner.model.modules() if isinstance(m, Int4WeightLinear))
    row = {"mode": args.mode, "tok_s": args.concurrency * NEW / wall, "steps": steps, "groups": group(steps),
           "words_modules": words, "fused": engine.runner.fused is not None,
           "summary": summary, "prefill_summary": prefill,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    print("RESULT " + json.dumps(row), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/int4-steps")
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--quant", default="int4-g128")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--workdir", default="/tmp/fourfold-bench-generate")
    p.add_argument("--modes", default="three copies,one copy",
                   help=f"comma-separated, of: {', '.join(MODES)}")
    p.add_argument("--one", dest="mode", default=None, help=argparse.SUPPRESS)   # the child's
    args = p.parse_args()
    if args.mode is not None:
        child(args)
        return 0
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for mode in modes:
        env = MODES[mode]
        child_args = ["--preset", args.preset, "--quant", args.quant, "--concurrency", str(args.concurrency),
                      "--workdir", args.workdir]
        row = run_variant_process(__file__, mode, 1, child_args,
                                  timeout=500, extra_env=env)
        if "error" in row:
            print(f"{mode}: failed\n{row['error']}")
            return 1
        rows.append(row)
        (out / f"kernels_{mode.replace(' ', '_')}.txt").write_text(row.pop("summary"))
        (out / f"prefill_{mode.replace(' ', '_')}.txt").write_text(row.pop("prefill_summary"))
    kinds = sorted({k for r in rows for k in r["groups"]}, key=lambda k: (k.split()[0], int(k.split()[-1])))
    lines = [f"{args.preset}, {args.quant}, {args.concurrency} concurrent requests (prompt {PROMPT}, {NEW} new), "
             f"{rows[0]['device']}, torch {rows[0]['torch']}", "",
             "| step kind | " + " | ".join(f"{r['mode']}: steps, mean ms, total ms" for r in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    for k in kinds:
        cells = []
        for r in rows:
            g = r["groups"].get(k)
            cells.append(f"{g['count']}, {g['ms'] / g['count']:.3f}, {g['ms']:.1f}" if g else "—")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines.append("| all | " + " | ".join(f"{len(r['steps'])}, , {sum(s['ms'] for s in r['steps']):.1f}"
                                         for r in rows) + " |")
    lines += ["", "tok/s end to end (a separate run, not synchronised per step): "
              + ", ".join(f"{r['mode']} {r['tok_s']:,.0f}" for r in rows),
              "int4 linears holding words: " + ", ".join(f"{r['mode']} {r['words_modules']}" for r in rows), ""]
    for r in rows:
        mixed = [f"{s['rows']} rows ({s['decode']} decode) {s['ms']:.2f} ms"
                 for s in r["steps"] if s["rows"] != s["decode"]]
        lines.append(f"{r['mode']}, steps with prefill tokens in order: " + "; ".join(mixed))
    (out / "int4_steps.json").write_text(json.dumps(rows, indent=1))
    (out / "int4_steps.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
