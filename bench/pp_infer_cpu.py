"""Pipeline-parallel inference on CPU: micro-batched stages (every stage busy) against one step in flight.

    python bench/pp_infer_cpu.py --out bench/results/pp-infer-cpu            # 2 gloo ranks, pp=2
    python bench/pp_infer_cpu.py --requests 8 --new-tokens 16 --repeats 1    # quicker (small batches)

Two processes (gloo, one thread each) hold one half of a random float32 Llama each (default dim 512,
8 layers, vocab 8192). In the same processes, alternately and `--repeats` times, both engines run the
same greedy requests (--requests random prompts of --prompt-len ids, --new-tokens each, end-of-sequence
ignored, all added at once):
  plain   EngineConfig(pipeline_micro_batching=False): LLMEngine over PipelineRunner, one step in flight
  micro   fourfold.infer.pipeline_engine: one micro-batch of requests per stage, stages overlap
Reported per variant (best repeat by tokens/s; rank 0's wall clock): generated tokens/s; per stage
the idle fraction 1 - (seconds in the stage's model forward) / (wall seconds) and the process CPU
seconds; and the fraction of the run during which both stages were inside their forward at once (from
the forwards' perf_counter spans, one clock for both processes): near 0 for one step in flight.
Each micro-batch step carries 1/S of the requests, so the gain is t(B) / t(B/S) for a stage's step time t
at batch B: near S where a step's cost grows with its tokens (prefill, large batches), near 1 where it is
fixed (small decode batches, bound by reading the weights); hence the default 64 requests of 64 tokens.
The ratio micro/plain is the speed-up; it needs a free core per stage (on a busy machine the stages only
take turns), so the script also prints the bound the CPU seconds allow: plain's stage seconds added up
over micro's busiest stage. The two engines' tokens are compared: with --dtype fp64 every request must be identical; in
fp32 a random model's near-tied logits can flip between two batchings of the same requests (the tests
check parity in float64). Writes pp_infer_cpu.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fourfold.config import build_config  # noqa: E402
from fourfold.precision import DTYPES  # noqa: E402
from fourfold.infer.engine_config import EngineConfig  # noqa: E402
from fourfold.infer.pipeline_engine import open_pipeline_engine  # noqa: E402
from fourfold.infer.requests import SamplingParams  # noqa: E402
from fourfold.models.llama import Llama  # noqa: E402
from fourfold.parallel.pipeline.split import split_pipeline  # noqa: E402
from fourfold.tokenizer import ByteTokenizer  # noqa: E402


class ForwardClock:
    """Seconds spent inside a module's forward, and each forward's (start, end) (hooks around it)."""

    def __init__(self, module: torch.nn.Module):
        self.seconds, self._start, self.spans = 0.0, 0.0, []
        module.register_forward_pre_hook(lambda *_: setattr(self, "_start", time.perf_counter()))
        module.register_forward_hook(lambda *_: self._stop())

    def _stop(self) -> None:
        end = time.perf_counter()
        self.seconds += end - self._start
        self.spans.append((self._start, end))


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds during which a span of `a` and a span of `b` both run (spans of each list are disjoint, sorted)."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += max(0.0, min(end, b[k][1]) - max(start, b[k][0]))
            k += 1
    return total


def run(engine, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    dist.barrier()
    start = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    tokens = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    return time.perf_counter() - start, [tokens[rid] for rid in ids]


def rank_main(rank: int, args, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    cfg = build_config({"model": dict(dim=args.dim, n_layers=args.layers, n_heads=args.dim // 64,
                                      n_kv_heads=max(args.dim // 256, 1), ffn_dim=4 * args.dim,
                                      vocab_size=args.vocab, max_seq_len=args.prompt_len + args.new_tokens + 8),
                        "train": {"seq_len": 8}}).model
    chunk = split_pipeline(Llama(cfg).to(DTYPES[args.dtype]).eval(), rank, 2)[0]
    clock = ForwardClock(chunk)
    engines = {name: open_pipeline_engine(chunk, ByteTokenizer(), EngineConfig(
        num_kv_blocks=args.requests * (-(-(args.prompt_len + args.new_tokens) // 16) + 1) * 2, block_size=16,
        max_num_batched_tokens=args.batched_tokens, enable_prefix_caching=False,
        pipeline_micro_batching=name == "micro"), torch.device("cpu"), None, [0, 1], dist.group.WORLD)
        for name in ("plain", "micro")}
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, args.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
    rows, outputs = [], {}
    for repeat in range(args.repeats + 1):  # repeat 0 warms up
        for name, engine in engines.items():
            busy, cpu, first_span = clock.seconds, time.process_time(), len(clock.spans)
            wall, tokens = run(engine, prompts, args.new_tokens, f"{name}{repeat}")
            outputs[name] = tokens
            if repeat:
                rows.append({"variant": name, "repeat": repeat, "rank": rank, "seconds": wall,
                             "tokens_per_s": sum(map(len, tokens)) / wall, "busy_s": clock.seconds - busy,
                             "idle_fraction": 1 - (clock.seconds - busy) / wall, "cpu_s": time.process_time() - cpu,
                             "spans": clock.spans[first_span:]})
    queue.put((rank, rows, sum(a == b for a, b in zip(outputs["plain"], outputs["micro"])) / len(prompts)))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--batched-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES),
                   help="fp64 makes the token comparison exact (fp32: a near-tie can flip between batchings)")
    p.add_argument("--out", default=None, help="folder for pp_infer_cpu.json")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args, port, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = []
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=5))
        except Exception:  # noqa: BLE001 - queue.Empty: see whether a rank died
            if any(proc.exitcode not in (None, 0) for proc in procs):
                for proc in procs:
                    proc.kill()
                sys.exit("a rank failed (its traceback is above)")
    for proc in procs:
        proc.join()
    rows = [row for _, part, _ in results for row in part]
    same = min(fraction for _, _, fraction in results)
    for row in rows:  # the fraction of the run during which both stages were inside their forward
        if row["rank"] == 0:
            other = next(r for r in rows
                         if r["rank"] == 1 and (r["variant"], r["repeat"]) == (row["variant"], row["repeat"]))
            row["both_busy_fraction"] = overlap_seconds(row["spans"], other["spans"]) / row["seconds"]
    for row in rows:
        del row["spans"]
    summary = {}
    for name in ("plain", "micro"):
        mine = [r for r in rows if r["variant"] == name]
        best = max((r for r in mine if r["rank"] == 0), key=lambda r: r["tokens_per_s"])
        summary[name] = {"tokens_per_s": best["tokens_per_s"], "all_tokens_per_s": sorted(
            r["tokens_per_s"] for r in mine if r["rank"] == 0),
            "idle_fraction_per_stage": [min(r["idle_fraction"] for r in mine if r["rank"] == k) for k in (0, 1)],
            "cpu_s_per_stage": [min(r["cpu_s"] for r in mine if r["rank"] == k) for k in (0, 1)],
            "both_busy_fraction": max(r["both_busy_fraction"] for r in mine if r["rank"] == 0)}
        print(f"{name:6s} {best['tokens_per_s']:8.1f} tok/s   stage idle "
              + "  ".join(f"{x:.0%}" for x in summary[name]["idle_fraction_per_stage"])
              + f"   both stages computing {summary[name]['both_busy_fraction']:.0%} of the time"
              + "   CPU s per stage " + "  ".join(f"{x:.2f}" for x in summary[name]["cpu_s_per_stage"]))
    ratio = summary["micro"]["tokens_per_s"] / summary["plain"]["tokens_per_s"]
    print(f"micro-batched / one step in flight: {ratio:.2f}x   requests with identical tokens: {same:.0%}")
    # What the CPU seconds allow with a core per stage: plain runs its stages one after the other, micro
    # at best side by side (an upper bound for micro / plain, whatever else the machine is running).
    bound = sum(summary["plain"]["cpu_s_per_stage"]) / max(summary["micro"]["cpu_s_per_stage"])
    print(f"CPU-seconds bound with a core per stage: {bound:.2f}x")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "pp_infer_cpu.json"), "w") as f:
            json.dump({"args": vars(args), "summary": summary, "ratio": ratio, "cpu_bound_ratio": bound,
                       "identical_requests": same, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
