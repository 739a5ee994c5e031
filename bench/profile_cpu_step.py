"""Where one CPU engine step goes: prefill and decode step times and a torch.profiler table of decode steps.

    python bench/profile_cpu_step.py --model /tmp/smollm2 [--batch 16] [--prompt-len 64] [--threads 2]
                                     [--steps 20] [--no-decoder] [--no-kernels] [--rows 25]

Loads the model as `bench/generate_cpu.py` does (bf16, packed linears), queues `--batch` random prompts,
times the prefill step and `--steps` decode steps (wall and process CPU time per step), then profiles
ten more decode steps and prints the ops by self time. `--no-decoder` runs the model's own forward over
the paged cache instead of the CPU step (fourfold.infer.cpu_decoder), for a before/after comparison;
`--no-kernels` runs the CPU step with torch ops in place of its fused C kernels (fourfold.infer.cpu_kernels).
The profiler does not see calls through ctypes, so while profiling each C kernel call is wrapped in a
record_function named `fourfold::<kernel>` (the wrapper adds a few microseconds a call to the table only).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.llm import LLM
from fourfold.infer.requests import SamplingParams


def timed(fn, repeat: int = 1) -> tuple[float, float]:
    """(wall ms, process CPU ms) per call of `fn`, over `repeat` calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeat):
        fn()
    return 1e3 * (time.perf_counter() - wall) / repeat, 1e3 * (time.process_time() - cpu) / repeat


def labelled(name: str, fn):
    """fn, its calls shown in the profile as `name`."""
    def call(*args):
        with record_function(name):
            return fn(*args)
    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--no-decoder", action="store_true")
    p.add_argument("--no-kernels", action="store_true")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = EngineConfig(max_num_seqs=a.batch, max_num_batched_tokens=a.batch * a.prompt_len, enable_prefix_caching=False,
                       fused_decoder=not a.no_decoder)
    llm = LLM(a.model, device="cpu", dtype=torch.bfloat16, config=cfg)
    engine = llm.engine
    decoder = engine.runner.cpu_decoder
    if decoder is not None and a.no_kernels:
        decoder.kernels = None
    kernels = decoder.kernels if decoder is not None else None
    vocab = engine.runner.model.cfg.vocab_size
    prompts = torch.randint(0, vocab, (a.batch, a.prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, warm, progress=False)
    params = SamplingParams(max_tokens=a.steps + 16, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params)
    prefill = timed(engine.step)
    decode = timed(engine.step, a.steps)
    step = "model forward" if a.no_decoder else "CPU step, " + ("C kernels" if kernels is not None else "torch ops")
    print(f"batch {a.batch}, {torch.get_num_threads()} threads, {step}: "
          f"prefill step {prefill[0]:.1f} ms wall / {prefill[1]:.1f} ms CPU; "
          f"decode step {decode[0]:.2f} ms wall / {decode[1]:.2f} ms CPU")
    if kernels is not None:
        for key, fn in list(kernels.fns.items()):
            kernels.fns[key] = labelled(f"fourfold::{key[0]}", fn)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.rows))
    while engine.has_unfinished():
        engine.step()


if __name__ == "__main__":
    main()
