"""Host-side cost of one inference-engine step (schedule, prepare, sample, read, outputs) with no model work.

    python bench/engine_host.py [--concurrency 1 64 256] [--prompt-len 128] [--new-tokens 256]
                                [--repeats 3] [--look-ahead] [--no-detokenize] [--profile 256] [--json out.json]

The engine (fourfold.infer.engine.LLMEngine) runs as `bench/generate.py` drives it on the GPU: all
requests go in through the offline `LLM.generate` loop (outputs consumed, text built), greedy, eos
ignored, but the model runner's `forward` returns fixed logits at once (two columns: greedy picks id 1,
a byte the byte tokenizer decodes), so every microsecond measured is Python bookkeeping plus the few
tiny CPU tensor ops the GPU run would launch. Times are this thread's CPU time (`time.thread_time`), so other processes on a
shared machine disturb them little; each concurrency runs `--repeats` times and the fastest run counts.

Phases, per engine step (averaged over every step of the run, prefill steps included):
  schedule   Scheduler.schedule + after_step (block allocation, prefix-cache registration)
  prepare    ModelRunner.prepare (tokens, positions, slot mapping, block tables, ...)
  sample     Sampler.sample and the launch bookkeeping around it
  read       reading the sampled ids back and applying stop conditions
  outputs    building RequestOutputs (detokenization) and the LLM.generate loop consuming them
`--no-detokenize` sets SamplingParams.detokenize=False (ids only, no per-token text). `--look-ahead` forces the CUDA path's overlapped look-ahead stepping (outputs one step late) on CPU,
to compare its host cost with the plain path. `--profile N` prints a cProfile table of a run at N.
The "host-bound tok/s" column is generated tokens over the host time: the ceiling the Python side
puts on end-to-end throughput when the GPU step is free.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import torch

from fourfold.infer.engine import LLMEngine
from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.kv_pool import KVPool
from fourfold.infer.llm import LLM
from fourfold.infer.model_runner import ModelRunner
from fourfold.infer.requests import SamplingParams
from fourfold.tokenizer import ByteTokenizer

from common import time_calls

WIDTH = 2
"""Logits columns: greedy picks id 1 every step; so narrow that the CPU argmax costs what a GPU launch does."""
PHASES = ("schedule", "prepare", "sample", "read", "outputs")


class InstantRunner(ModelRunner):
    """The real runner's host work (prepare, uploads) with a forward that returns fixed logits at once."""

    def __init__(self, pool: KVPool, max_seqs: int):
        super().__init__(None, pool, torch.device("cpu"), fuse=False)
        self.logits = torch.zeros(max_seqs, WIDTH)
        self.logits[:, 1] = 1.0

    def forward(self, st):
        return self.logits[:st.logits_for.shape[0]]


def build(concurrency: int, max_len: int, look_ahead: bool, batched_tokens: int) -> LLM:
    cfg = EngineConfig(block_size=16, max_num_seqs=max(concurrency, 1), max_num_batched_tokens=batched_tokens)
    blocks = concurrency * -(-max_len // cfg.block_size) + 16
    pool = KVPool(1, blocks, cfg.block_size, 1, 1, torch.float32, torch.device("cpu"))
    engine = LLMEngine(InstantRunner(pool, max(concurrency, 1)), ByteTokenizer(), cfg, 2048)
    engine.overlap = look_ahead  # the CUDA default path (outputs one step late, look-ahead launches)
    llm = object.__new__(LLM)  # LLM's loop over an engine we built ourselves
    llm.engine, llm._next_id = engine, 0
    return llm


def instrument(engine: LLMEngine, totals: dict) -> None:
    """Wrap the engine's phase methods so their thread CPU time adds up in `totals`."""
    def timed(owner, name, phase):
        time_calls(owner, name, totals, phase, time.thread_time)

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.scheduler, "after_step", "schedule")
    timed(engine.runner, "prepare", "prepare")
    timed(engine.sampler, "sample", "sample_only")
    timed(engine, "_launch", "launch")
    timed(engine, "_read", "read")
    timed(engine, "step", "step")


def run_once(concurrency: int, args) -> dict:
    llm = build(concurrency, args.prompt_len + args.new_tokens, args.look_ahead, args.max_batched_tokens)
    totals = dict.fromkeys(["schedule", "prepare", "sample_only", "launch", "read", "step"], 0.0)
    steps = [0]
    instrument(llm.engine, totals)
    inner_step = llm.engine.step

    def counted_step():
        steps[0] += 1
        return inner_step()
    llm.engine.step = counted_step
    prompts = [[(7 * i + j) % 256 for j in range(args.prompt_len)] for i in range(concurrency)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    if args.no_detokenize:  # token ids only, as the Hugging Face peers of bench/generate.py return
        params.detokenize = False
    t0 = time.thread_time()
    results = llm.generate(prompts, params, progress=False)
    total = time.thread_time() - t0
    tokens = sum(len(r.token_ids) for r in results)
    assert tokens == concurrency * args.new_tokens
    n = steps[0]
    launch_rest = totals["launch"] - totals["schedule"] - totals["prepare"]  # schedule/prepare run inside _launch
    phases = {"schedule": totals["schedule"], "prepare": totals["prepare"], "sample": launch_rest,
              "read": totals["read"], "outputs": total - totals["launch"] - totals["read"]}
    row = {"concurrency": concurrency, "steps": n, "tokens": tokens, "host_s": total,
           "look_ahead": args.look_ahead, "look_aheads": llm.engine.look_aheads,
           "us_per_step": 1e6 * total / n, "host_bound_tok_s": tokens / total}
    row.update({f"{k}_us": 1e6 * v / n for k, v in phases.items()})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--max-batched-tokens", type=int, default=4096, help="as bench/generate.py's default")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--look-ahead", action="store_true")
    parser.add_argument("--no-detokenize", action="store_true", help="SamplingParams(detokenize=False)")
    parser.add_argument("--profile", type=int, default=0, help="print a cProfile table of one run at this size")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"{'conc':>5} {'steps':>5} {'us/step':>9} " + " ".join(f"{p:>9}" for p in PHASES) + f" {'host tok/s':>11}")
    for c in args.concurrency:
        row = min((run_once(c, args) for _ in range(args.repeats)), key=lambda r: r["host_s"])
        rows.append(row)
        print(f"{c:>5} {row['steps']:>5} {row['us_per_step']:>9.1f} "
              + " ".join(f"{row[p + '_us']:>9.1f}" for p in PHASES) + f" {row['host_bound_tok_s']:>11,.0f}")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        run_once(args.profile, args)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
