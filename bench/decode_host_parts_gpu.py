"""Host time of each part of a one-sequence decode step (GPU), and the step, from wrappers with perf_counter.

    python bench/decode_host_parts_gpu.py [--quant int4-g128] [--json out.json]

Builds the engine `bench/generate.py` builds (llama-1b, random weights, --quant converted, default EngineConfig:
CUDA graphs, look-ahead), runs three 128 + 256-token greedy requests one after another through `LLMEngine.step`
and prints, for the last, the wall time per step and per call of: step, _launch (schedule, prepare, graph replay,
download), prepare (host_step + staging the graph's inputs), upload (pinned copies), host_step, the graph inputs'
host array, forward_greedy, replay, download, _fill_placeholders, _read (mostly waiting for the step's event),
Event.synchronize, schedule and build_outputs. Unlike a profiler (whose CUDA tracing makes a graph launch take
~300 us here) the wrappers cost well under a microsecond each. Where `_read` takes most of a step the host waits
for the GPU; where `_launch` does, the host bounds the step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

import generate  # noqa: E402
from common import time_calls  # noqa: E402
from fourfold.infer import cuda_graphs, engine as engine_module, model_runner  # noqa: E402
from fourfold.infer.requests import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default=None, help="a fourfold.quant scheme (e.g. int4-g128); default bf16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    setup = argparse.Namespace(workdir="/tmp/fourfold-bench-generate", preset="llama-1b", device="cuda",
                               max_num_seqs=256, max_batched_tokens=4096)
    engine = generate.build_llm(setup, args.quant).engine
    totals, counts = defaultdict(float), defaultdict(int)
    runner = engine.runner
    for owner, name, label in (
            (model_runner, "host_step", None), (cuda_graphs.StaticDecodeInputs, "host_bytes", "graph inputs"),
            (cuda_graphs.StaticDecodeInputs, "host_buffers", "graph inputs"), (runner, "upload", None),
            (runner, "download", None), (runner, "prepare", None), (runner, "forward_greedy", None),
            (runner.graphs.graphs[1], "replay", None), (torch.cuda.Event, "synchronize", "Event.synchronize"),
            (engine, "_fill_placeholders", None), (engine, "_read", None), (engine, "_launch", None),
            (engine.scheduler, "schedule", None), (engine_module, "build_outputs", None), (engine, "step", None)):
        if hasattr(owner, name):  # main's tree has host_buffers where this one has host_bytes
            time_calls(owner, name, totals, label or name, counts=counts)
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True, detokenize=False)
    for rep in range(3):
        totals.clear()
        counts.clear()
        engine.add_request(f"r{rep}", list(range(3, 131)), params)
        steps, t0 = 0, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    parts = {k: {"calls": counts[k], "us_per_step": 1e6 * totals[k] / steps, "us_per_call": 1e6 * totals[k] / counts[k]}
             for k in sorted(totals, key=lambda k: -totals[k])}
    print(f"quant={args.quant} {steps} steps (prefill included), {1e3 * wall:.3f} ms a step")
    for k, v in parts.items():
        print(f"  {k:20s} calls {v['calls']:5d}  {v['us_per_step']:8.1f} us a step  {v['us_per_call']:8.1f} us a call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"quant": args.quant, "steps": steps, "ms_per_step": 1e3 * wall, "parts": parts}, f, indent=2)


if __name__ == "__main__":
    main()
