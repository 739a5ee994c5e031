"""Where a one-sequence decode step's time goes past its CUDA graph (GPU): graph time, the gaps between graphs, whether
the host was late, and the garbage collector's runs, through `LLM.generate` and through `LLMEngine.step`.

    python bench/decode_timeline_gpu.py [--quant int4-g128] [--rounds 3] [--instrument full|events|none] [--json F]

Builds the engine `bench/generate.py` builds (llama-1b, random weights, --quant converted, default EngineConfig:
CUDA graphs, look-ahead) and warms it up as generate.py does (4 tokens of another prompt). First it replays
generate.py's own sequence: a timed 128 + 256-token greedy request, generate.py's ms a step from that request's time,
and three figures that each time a long and a short request of their own, with the step times of the first request.
Then it runs 128 + 256-token requests, alternating the two drivers, --rounds times. Each replay of the
one-sequence decode graph is bracketed by two CUDA events, so the GPU's own clock gives each graph's time and the
gap before the next one (the inputs' copy, the look-ahead token copy, the ids' read-back and any time the GPU
waited for the host). At each `_launch` the previous graph's end event is queried: if it has already passed, the
GPU sat idle until the host launched (a host-bound step). Every cyclic-GC run is timed through gc.callbacks.
`--instrument events` leaves out the query, `none` wraps nothing (ms a step only).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

import generate  # noqa: E402
from fourfold.infer.requests import SamplingParams  # noqa: E402

PROMPT, NEW = 128, 256


def recording(fn, durations: list[float], before=None):
    """`fn` wrapped so that each call's perf_counter time goes onto `durations` (`before()` runs first, untimed)."""
    def wrapped(*args):
        if before is not None:
            before()
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            durations.append(time.perf_counter() - t0)
    return wrapped


def slowest(durations: list[float], n: int) -> list[tuple[int, float]]:
    """(index, us) of the `n` longest calls."""
    return [(i, round(1e6 * durations[i], 1)) for i in sorted(range(len(durations)), key=lambda i: -durations[i])[:n]]


class Timeline:
    """Events around every replay of `graph`, and the host's view at every `engine._launch` and `engine._read`."""

    def __init__(self, engine, graph, query: bool = True):
        self.replays: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.idle_at_launch: list[bool] = []
        self.launch_s: list[float] = []
        self.read_s: list[float] = []
        self.collections: list[tuple[int, float]] = []  # (generation, seconds) of each cyclic-GC run
        gc_start = [0.0]

        def on_gc(phase, info):
            if phase == "start":
                gc_start[0] = time.perf_counter()
            else:
                self.collections.append((info["generation"], time.perf_counter() - gc_start[0]))
        gc.callbacks.append(on_gc)
        replay = graph.replay

        def timed_replay():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay()
            end.record()
            self.replays.append((start, end))

        def note_idle():
            if query and self.replays:
                self.idle_at_launch.append(self.replays[-1][1].query())

        graph.replay = timed_replay
        engine._launch = recording(engine._launch, self.launch_s, before=note_idle)
        engine._read = recording(engine._read, self.read_s)

    def clear(self) -> None:
        for records in (self.replays, self.idle_at_launch, self.launch_s, self.read_s, self.collections):
            records.clear()

    def summary(self) -> dict:
        """Per-step figures over the replays since `clear` (us), after the GPU has finished them."""
        torch.cuda.synchronize()
        graph = [1e3 * s.elapsed_time(e) for s, e in self.replays]
        gaps = [1e3 * self.replays[i - 1][1].elapsed_time(self.replays[i][0]) for i in range(1, len(self.replays))]
        gaps.sort()
        return {"replays": len(graph), "graph_us": statistics.mean(graph), "gap_us": statistics.mean(gaps),
                "gap_p50_us": gaps[len(gaps) // 2], "gap_p90_us": gaps[int(0.9 * len(gaps))], "gap_max_us": gaps[-1],
                "gaps_over_50us": sum(g > 50 for g in gaps), "gaps_over_50us_total_us": sum(g for g in gaps if g > 50),
                "launches_with_gpu_idle": sum(self.idle_at_launch), "launches": len(self.idle_at_launch),
                "launch_us": 1e6 * statistics.mean(self.launch_s), "read_us": 1e6 * statistics.mean(self.read_s),
                "slowest_launches": slowest(self.launch_s, 3),
                "gc_runs": [(g, round(1e6 * s, 1)) for g, s in self.collections]}


def through_llm(llm, prompt: list[int], params: SamplingParams) -> None:
    llm.generate([prompt], params, progress=False)


def through_engine(llm, prompt: list[int], params: SamplingParams) -> None:
    engine = llm.engine
    engine.add_request(f"timeline-{time.monotonic_ns()}", prompt, params)
    while engine.has_unfinished():
        engine.step()


def generate_py_sequence(llm, setup, vocab: int, long_prompt: list[int], quant) -> dict:
    """generate.py's own sequence after its warm-up: a timed request, then its three ms-a-step figures (each reusing
    that request's time), then three that each time their own long request; and the first request's step times."""
    first, inner_step = [], llm.engine.step
    llm.engine.step = recording(inner_step, first)
    elapsed, _ = generate.timed_generate(llm, [long_prompt], NEW)
    llm.engine.step = inner_step
    reused = [generate.decode_ms_per_step(llm, setup, vocab, elapsed) for _ in range(3)]
    fresh = [generate.decode_ms_per_step(llm, setup, vocab) for _ in range(3)]
    print(f"quant={quant} generate.py's three figures (the first request's time reused): "
          f"{[round(v, 4) for v in reused]}; each with its own long request: {[round(v, 4) for v in fresh]}")
    print(f"  first request: wall {1e3 * elapsed:.2f} ms, {len(first)} steps, {1e3 * sum(first):.2f} ms in step(), "
          f"slowest steps (index, us) {slowest(first, 6)}, "
          f"median {1e6 * statistics.median(first):.0f} us", flush=True)
    return {"driver": "generate.py", "reused": reused, "fresh": fresh, "first_request_ms": 1e3 * elapsed,
            "first_request_step_us": [round(1e6 * v, 1) for v in first]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default=None, help="a fourfold.quant scheme (e.g. int4-g128); default bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--instrument", choices=["full", "events", "none"], default="full",
                        help="events: no query at launch; none: wall time only (nothing wrapped)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    setup = argparse.Namespace(workdir="/tmp/fourfold-bench-generate", preset="llama-1b", device="cuda",
                               max_num_seqs=256, max_batched_tokens=4096, prompt_len=PROMPT, new_tokens=NEW)
    llm = generate.build_llm(setup, args.quant)
    vocab = generate.preset_vocab(setup)
    long_prompt = generate.prompts_for(1, PROMPT, vocab, seed=1)[0]
    # generate.py's warm-up: 4 tokens on another prompt
    through_llm(llm, generate.prompts_for(1, PROMPT, vocab, seed=10_001)[0],
                SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False))
    rows = [generate_py_sequence(llm, setup, vocab, long_prompt, args.quant)]
    timeline = None
    if args.instrument != "none":
        timeline = Timeline(llm.engine, llm.engine.runner.graphs.graphs[1], query=args.instrument == "full")
    params = {n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False) for n in (NEW, 32)}
    for rnd in range(args.rounds):
        for name, drive in (("LLM.generate", through_llm), ("LLMEngine.step", through_engine)):
            wall = {}
            for n in (NEW, 32):  # ms a decode step: the difference of a long and a short request, as generate.py
                torch.cuda.synchronize()
                if timeline is not None:
                    timeline.clear()
                t0 = time.perf_counter()
                drive(llm, long_prompt, params[n])
                torch.cuda.synchronize()
                wall[n] = time.perf_counter() - t0
                if n == NEW:
                    row = {"round": rnd, "driver": name, **(timeline.summary() if timeline is not None else {})}
            row["ms_per_step"] = 1e3 * (wall[NEW] - wall[32]) / (NEW - 32)
            rows.append(row)
            if timeline is None:
                print(f"quant={args.quant} {name:15s} {row['ms_per_step']:.3f} ms a step (nothing wrapped)", flush=True)
                continue
            print(f"quant={args.quant} {name:15s} {row['ms_per_step']:.3f} ms a step | graph {row['graph_us']:.1f} us, "
                  f"gap mean {row['gap_us']:.1f} p50 {row['gap_p50_us']:.1f} p90 {row['gap_p90_us']:.1f} "
                  f"max {row['gap_max_us']:.1f} us, {row['gaps_over_50us']} gaps > 50 us "
                  f"({row['gaps_over_50us_total_us']:.0f} us) | GPU idle at {row['launches_with_gpu_idle']}/"
                  f"{row['launches']} launches | host _launch {row['launch_us']:.1f} us, _read {row['read_us']:.1f} us"
                  f" | slowest launches {row['slowest_launches']} | gc {row['gc_runs']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"quant": args.quant, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
