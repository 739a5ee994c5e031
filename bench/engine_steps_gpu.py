"""Where a GPU engine step's wall time goes, with and without look-ahead, at a few concurrencies (one H200).

    python bench/engine_steps_gpu.py --out DIR [--concurrency 64 256] [--look-ahead-max-seqs 0 256]
                                     [--preset llama-1b] [--prompt-len 128] [--new-tokens 256] [--trace]

Builds a random-weight `--preset` model in bf16 on CUDA and an LLMEngine with the defaults
bench/generate.py uses (256 sequences, 4096-token steps), then for every look_ahead_max_seqs value
(0: never look ahead; 256: always) and concurrency runs the prompts to the end (greedy, eos ignored,
detokenize off) while timing, in wall time, each part of `LLMEngine.step`: schedule (+ after_step),
prepare (host build + uploads), forward (graph replay launch), sample, read-wait (blocked on the
sampled ids' event), apply (stop checks), outputs. Side by side in one process, so the look-ahead
and plain rows compare directly; tok/s is end to end. `--trace` also writes a torch.profiler chrome
trace of 12 steady decode steps at the largest concurrency with look-ahead (trace_look_ahead.json).
Every engine schedules over the same KV pool: `--num-kv-blocks`, or (0) as many blocks as the first
engine got from gpu_memory_utilization; each row records the pool size and the preemptions, since a
smaller pool means preemptions and more steps for the same tokens (an earlier version of this script
sized the second engine's pool while the first engine, held by reference cycles, still had its memory:
its look-ahead rows ran on the leftovers, 443 steps at 256 where the plain rows took 265).
Writes engine_steps.json and engine_steps.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict

import torch

from fourfold.config import build_config
from fourfold.infer import engine as engine_module
from fourfold.infer.engine import LLMEngine
from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.requests import SamplingParams
from fourfold.models.llama import Llama
from fourfold.tokenizer import ByteTokenizer

from common import time_calls

PARTS = ("schedule", "prepare", "forward", "sample", "read_wait", "apply", "outputs")


def timed(owner, name, totals, part):
    time_calls(owner, name, totals, part)


def run(engine: LLMEngine, prompts, new_tokens: int, sync) -> tuple[float, int, int]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    sync()
    steps, tokens, t0 = 0, 0, time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.token_ids) for o in engine.step())
        steps += 1
    sync()
    return time.perf_counter() - t0, tokens, steps


def instrument(engine: LLMEngine, totals: dict):
    """Wrap the step's parts so their wall time adds up in `totals`; returns a function that undoes the
    module-level wraps (the per-object ones go with the engine)."""
    timed(engine.scheduler, "schedule", totals, "schedule")
    timed(engine.scheduler, "after_step", totals, "schedule")
    timed(engine.runner, "prepare", totals, "prepare")
    timed(engine.runner, "forward", totals, "forward")
    timed(engine.sampler, "sample", totals, "sample")
    timed(engine, "_read", totals, "read_wait")  # apply is subtracted below

    apply_tokens, build_outputs = engine_module.apply_tokens, engine_module.build_outputs

    def apply(*args):
        t0 = time.perf_counter()
        try:
            return apply_tokens(*args)
        finally:
            totals["apply"] += time.perf_counter() - t0

    def outputs(*args):
        t0 = time.perf_counter()
        try:
            return build_outputs(*args)
        finally:
            totals["outputs"] += time.perf_counter() - t0
    engine_module.apply_tokens, engine_module.build_outputs = apply, outputs

    def undo():
        engine_module.apply_tokens, engine_module.build_outputs = apply_tokens, build_outputs
    return undo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--look-ahead-max-seqs", type=int, nargs="+", default=[0, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--num-kv-blocks", type=int, default=0,
                        help="KV pool of every engine; 0: what the first engine gets from gpu_memory_utilization 0.6")
    parser.add_argument("--device", default="cuda", help="cpu only checks the script runs (no overlap there)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cfg = build_config({"model": {"preset": args.preset}})
    with torch.device(device):
        model = Llama(cfg.model).to(torch.bfloat16).eval()
    vocab = cfg.model.vocab_size
    rows, num_kv_blocks = [], args.num_kv_blocks
    for max_seqs in args.look_ahead_max_seqs:
        engine = LLMEngine.from_model(model, ByteTokenizer(), EngineConfig(
            max_num_seqs=256, max_num_batched_tokens=4096, look_ahead_max_seqs=max_seqs, gpu_memory_utilization=0.6,
            kv_cache_bytes=64 << 20, num_kv_blocks=num_kv_blocks), device)
        num_kv_blocks = engine.blocks.num_blocks  # the next engines get the same pool
        totals: dict = defaultdict(float)
        undo = instrument(engine, totals)
        for c in args.concurrency:
            gen = torch.Generator().manual_seed(c)
            prompts = torch.randint(0, vocab, (c, args.prompt_len), generator=gen).tolist()
            run(engine, prompts[:4], 4, sync)  # warm-up
            totals.clear()
            before, preempted = engine.look_aheads, engine.scheduler.preemptions
            seconds, tokens, steps = run(engine, prompts, args.new_tokens, sync)
            row = {"concurrency": c, "look_ahead_max_seqs": max_seqs, "tokens_per_s": tokens / seconds,
                   "ms_per_step": 1e3 * seconds / steps, "steps": steps,
                   "look_aheads": engine.look_aheads - before, "kv_blocks": num_kv_blocks,
                   "preemptions": engine.scheduler.preemptions - preempted}
            totals["read_wait"] -= totals["apply"]
            row.update({f"{p}_ms": 1e3 * totals[p] / steps for p in PARTS})
            row["other_ms"] = row["ms_per_step"] - sum(row[f"{p}_ms"] for p in PARTS)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.trace and max_seqs >= c and c == max(args.concurrency):
                trace(engine, prompts, args)
        undo()
        engine.close()  # the wrappers and the runner's CUDA graphs hold the engine in frozen reference cycles
    with open(os.path.join(args.out, "engine_steps.json"), "w") as f:
        json.dump(rows, f, indent=1)
    header = ("| concurrency | look_ahead_max_seqs | kv blocks | steps | look-aheads | preemptions | tok/s | ms/step | "
              + " | ".join(PARTS) + " | other |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['look_ahead_max_seqs']} | {r['kv_blocks']} | {r['steps']} | "
                     f"{r['look_aheads']} | {r['preemptions']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['ms_per_step']:.3f} | " + " | ".join(f"{r[p + '_ms']:.3f}" for p in PARTS)
                     + f" | {r['other_ms']:.3f} |")
    with open(os.path.join(args.out, "engine_steps.md"), "w") as f:
        f.write("Per engine step, wall ms (host side; read_wait = blocked on the sampled ids).\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


def trace(engine: LLMEngine, prompts, args) -> None:
    """A chrome trace of 12 steady decode steps (after the prefill) with look-ahead."""
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, detokenize=False)
    for i, p in enumerate(prompts):
        engine.add_request(f"t{i}", p, params)
    for _ in range(30):
        engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(12):
            engine.step()
    prof.export_chrome_trace(os.path.join(args.out, "trace_look_ahead.json"))
    while engine.has_unfinished():
        engine.step()


if __name__ == "__main__":
    main()
