"""Parallel offline generation: the engine on one GPU, tensor-parallel on two and pipeline-parallel on two.

    python bench/generate_parallel.py --out bench/results/generate-parallel-h200x2 --workdir /tmp/ff-gp
    python bench/generate_parallel.py --preset tiny --device cpu --out /tmp/gp --workdir /tmp/gp-work  # smoke test

Model: a preset (default `llama3-8b`) in bf16 with random weights, written once as a fourfold checkpoint to
--workdir (filled with normal(0, 0.02) on the device itself; models/init.py's per-block CPU draws are
exact but slow for 8B). Prompts of 128 random ids, 256 new tokens, greedy, end-of-sequence ignored, at 1,
64 and 256 concurrent requests, end to end (prefill included), for each variant in its own process:
  tp1   LLM-style engine on one device
  tp2   two ranks (torchrun), each loading only its tensor-parallel shards (NCCL on GPUs, gloo on CPUs)
  pp2   two pipeline stages, each holding half the blocks, micro-batched (fourfold.infer.pipeline_engine:
        one micro-batch of requests per stage, the stages overlap)
  pp2one  the same stages with one step in flight (EngineConfig.pipeline_micro_batching=false)
The ranks of a variant run identical engines fed the same requests (as tests/distributed/test_tp_inference.py
does); rank 0 reports. Batch-1 ms/step is the difference of a 256- and a 32-token run. Each variant also
generates 8 prompts x 32 greedy tokens; the parent compares tp2 and pp2 with tp1 token by token (bf16:
a different reduction order can flip an argmax between two near-equal logits, after which the sequences
diverge; the first differing position per prompt is reported). Writes generate_parallel.json (after every
variant) and generate_parallel.md to --out. NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT, BENCH]

from common import read_child  # noqa: E402

NPROC = {"write": 1, "tp1": 1, "tp2": 2, "pp2": 2, "pp2one": 2}
TIMEOUTS = {"write": 240, "tp1": 180, "tp2": 180, "pp2": 180, "pp2one": 180}
PARITY_PROMPTS, PARITY_TOKENS = 8, 32


def say(*parts) -> None:
    print(*parts, flush=True)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def report(row: dict) -> None:
    if rank() == 0:
        say("RESULT " + json.dumps(row))


def progress(text: str) -> None:
    if rank() == 0:
        say("PROGRESS " + text)


def prompts_for(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()


def run_dir(args) -> str:
    return os.path.join(args.workdir, f"model-{args.preset}")


# ---------------------------------------------------------------- children

def fast_init_weights(self, seed=None) -> None:
    """Rotary tables only: every parameter is then read from the checkpoint (load_model's init_weights would
    first draw all 8B values on the CPU, block by block, only to overwrite them)."""
    import torch

    from fourfold.models.llama import rotary_tables

    if self.rope_cos.device.type != "meta":
        cos, sin = rotary_tables(self.cfg)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)


def write_model(args) -> None:
    """The preset with normal(0, 0.02) weights drawn on the device (norms 1), saved as a bf16 checkpoint."""
    import torch

    from fourfold.checkpoint.store import latest_checkpoint, save_checkpoint
    from fourfold.config import build_config
    from fourfold.models.llama import Llama

    path = run_dir(args)
    if latest_checkpoint(path) is not None:
        say(f"PROGRESS checkpoint already in {path}")
        return
    t0 = time.perf_counter()
    cfg = build_config({"model": {"preset": args.preset}})
    with torch.device("meta"):
        model = Llama(cfg.model).to(torch.bfloat16)
    model.to_empty(device=torch.device(args.device))
    gen = torch.Generator(device=args.device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=args.device, dtype=torch.float32).mul_(0.02))
    fast_init_weights(model)
    say(f"PROGRESS drew {sum(p.numel() for p in model.parameters()) / 1e6:,.0f}M parameters in "
        f"{time.perf_counter() - t0:.1f}s")
    save_checkpoint(path, 0, model, None, {"step": 0, "config": cfg.to_dict(), "tokenizer": "byte"}, keep=1)
    say(f"PROGRESS wrote {path} in {time.perf_counter() - t0:.1f}s")
    report({"variant": "write", "seconds": time.perf_counter() - t0})


def engine_overrides(text: str) -> dict:
    """EngineConfig fields from "name=value,..." (true/false, integers, floats)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=", 1)
        low = value.lower()
        out[key.strip()] = low == "true" if low in ("true", "false") else float(value) if "." in value else int(value)
    return out


def build_engine(args, variant: str):
    """This rank's engine for the variant (tp1: one process; tp2 / pp2: under torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fourfold.distributed import init_distributed
    from fourfold.infer.engine import LLMEngine
    from fourfold.infer.engine_config import EngineConfig
    from fourfold.infer.loading import load_model
    from fourfold.infer.pipeline_engine import open_pipeline_engine
    from fourfold.models.llama import Llama

    Llama.init_weights = fast_init_weights  # the checkpoint supplies every parameter
    t0 = time.perf_counter()
    env = init_distributed(args.device)
    device = env.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)  # the checkpoint is bf16; float32 upcasts it exactly (a parity run)
    cfg = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                       cuda_graphs=args.graphs == "on", kv_cache_bytes=args.kv_cache_bytes,
                       **engine_overrides(args.engine))
    parallel = {}
    if variant == "tp2":
        mesh = init_device_mesh(device.type, (env.world_size,), mesh_dim_names=("tp",))
        loaded = load_model(run_dir(args), device, dtype, tp_mesh=mesh)
        parallel = {"group": dist.group.WORLD, "sampling_seed": 0}
    elif variant in ("pp2", "pp2one"):
        loaded = load_model(run_dir(args), device, dtype, pp=(env.rank, env.world_size))
        cfg.pipeline_micro_batching = variant == "pp2"
        engine = open_pipeline_engine(loaded.model, loaded.tokenizer, cfg, device, loaded.kv_heads,
                                      list(range(env.world_size)), dist.group.WORLD, sampling_seed=0)
        progress(f"{variant}: engine ready in {time.perf_counter() - t0:.1f}s on {device}")
        return engine, loaded.config.model.vocab_size
    else:
        loaded = load_model(run_dir(args), device, dtype)
    engine = LLMEngine.from_model(loaded.model, loaded.tokenizer, cfg, device, loaded.kv_heads, **parallel)
    progress(f"{variant}: engine ready in {time.perf_counter() - t0:.1f}s on {device}")
    return engine, loaded.config.model.vocab_size


def generate(engine, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    """Seconds (synchronised) and the generated ids of every prompt, run to completion on this engine."""
    import torch

    from fourfold.infer.requests import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, params)
    tokens = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    sync()
    return time.perf_counter() - t0, [tokens[rid] for rid in ids]


def run_engine_variant(args, variant: str) -> None:
    engine, vocab = build_engine(args, variant)
    _, parity = generate(engine, prompts_for(PARITY_PROMPTS, args.prompt_len, vocab, seed=4242), PARITY_TOKENS,
                         "parity")
    report({"variant": variant, "kind": "parity", "tokens": parity})
    for c in args.concurrency:
        generate(engine, prompts_for(c, args.prompt_len, vocab, seed=10_000 + c), 4, f"warm{c}")
        elapsed, out = generate(engine, prompts_for(c, args.prompt_len, vocab, seed=c), args.new_tokens, f"c{c}")
        tokens = sum(len(t) for t in out)
        row = {"variant": variant, "kind": "throughput", "concurrency": c, "tokens": tokens, "seconds": elapsed,
               "tokens_per_s": tokens / elapsed}
        if c == 1:
            short, _ = generate(engine, prompts_for(1, args.prompt_len, vocab, seed=5), 32, "short")
            row["ms_per_step"] = 1000 * (elapsed - short) / (args.new_tokens - 32)
        report(row)
    if os.environ.get("WORLD_SIZE", "1") != "1":
        import torch.distributed as dist

        dist.barrier()
    # Tearing down a 2-rank engine (process group, DTensor, gloo threads) sometimes aborted after every figure
    # was out; the figures are printed, so leave without destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- parent

def launch(args, name: str, budget_left: float, graphs: str, engine: str) -> list[dict]:
    """Run one variant (torchrun for two ranks) with a timeout; its RESULT rows, or one error row."""
    child = [os.path.abspath(__file__), "--one", name, *args.child_argv, "--graphs", graphs, "--engine", engine]
    if NPROC[name] > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC[name]}",
               *child]
    else:
        cmd = [sys.executable, *child]
    timeout = max(20.0, min(TIMEOUTS[name] * args.timeout_scale, budget_left))
    say(f"== {name} (graphs {graphs}, engine {engine or 'defaults'}, timeout {timeout:.0f}s)")
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
                            start_new_session=True)

    def annotate(row: dict) -> None:
        row["graphs"], row["engine"] = graphs, engine
        if row.get("kind") == "throughput":
            say(f"   {name} c={row['concurrency']:<4d} {row['tokens_per_s']:10,.0f} tok/s"
                + (f"  {row['ms_per_step']:.2f} ms/step" if "ms_per_step" in row else ""))

    rows, tail = read_child(proc, name, timeout, lambda: os.killpg(proc.pid, 9), annotate, say)
    if proc.returncode != 0 and not any("error" in r for r in rows):
        done = sum(r.get("kind") == "throughput" for r in rows) == len(args.concurrency) or name == "write"
        if done and rows:  # every figure came: a failure while tearing down is recorded, not fatal
            rows.append({"variant": name, "warning": f"exit code {proc.returncode} after its results: "
                         + "\n".join(tail[-6:])})
            say(f"   {name} exited with {proc.returncode} after reporting every figure (kept)")
        else:
            rows.append({"variant": name, "error": "\n".join(tail[-25:])})
    if rows and "error" in rows[-1]:
        say("   FAILED: " + rows[-1]["error"][-1500:])
    return rows


def parity(rows: list[dict]) -> dict:
    """Per variant: the fraction of tp1's parity tokens it matched and the first differing position per prompt."""
    outs = {r["variant"]: r["tokens"] for r in rows if r.get("kind") == "parity"}
    if "tp1" not in outs:
        return {}
    ref, result = outs["tp1"], {}
    for name, got in outs.items():
        if name == "tp1":
            continue
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None if len(x) == len(y) else
                      min(len(x), len(y))) for x, y in zip(ref, got)]
        same = sum(a == b for x, y in zip(ref, got) for a, b in zip(x, y))
        result[name] = {"match_rate": same / sum(len(x) for x in ref), "identical_prompts": first.count(None),
                        "prompts": len(ref), "first_diff": first}
    return result


def summarize(rows: list[dict], args) -> tuple[dict, str]:
    tput = {(r["variant"], r["concurrency"]): r for r in rows if r.get("kind") == "throughput"}
    ratios = {}
    for c in args.concurrency:
        for num, den in (("tp2", "tp1"), ("pp2", "tp2"), ("pp2", "tp1"), ("pp2", "pp2one")):
            if (num, c) in tput and (den, c) in tput:
                ratios[f"{num}/{den} c={c}"] = tput[(num, c)]["tokens_per_s"] / tput[(den, c)]["tokens_per_s"]
    for num, den in (("tp2", "tp1"), ("pp2", "tp2")):
        a, b = tput.get((num, 1), {}).get("ms_per_step"), tput.get((den, 1), {}).get("ms_per_step")
        if a and b:
            ratios[f"{num}/{den} batch-1 ms/step"] = a / b
    par = parity(rows)
    lines = [f"`{args.preset}` {args.dtype}, random weights, prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy, "
             f"device {args.device}; tokens/s end to end (prefill included).", "",
             "| variant | " + " | ".join(f"c={c} tok/s" for c in args.concurrency) + " | batch-1 ms/step |",
             "|---|" + "---:|" * (len(args.concurrency) + 1)]
    for v in ("tp1", "tp2", "pp2", "pp2one"):
        cells = [f"{tput[(v, c)]['tokens_per_s']:,.0f}" if (v, c) in tput else "—" for c in args.concurrency]
        ms = tput.get((v, 1), {}).get("ms_per_step")
        lines.append(f"| {v} | " + " | ".join(cells) + f" | {ms:.2f} |" if ms else f"| {v} | " + " | ".join(cells)
                     + " | — |")
    lines += ["", "| ratio | value |", "|---|---:|"] + [f"| {k} | {v:.3f} |" for k, v in ratios.items()]
    lines += ["", f"Greedy parity vs tp1 ({PARITY_PROMPTS} prompts x {PARITY_TOKENS} tokens; bf16: a different "
              "reduction order can flip an argmax between near-equal logits, after which a sequence diverges):", ""]
    for name, p in par.items():
        lines.append(f"- {name}: {100 * p['match_rate']:.1f}% of tokens match, {p['identical_prompts']}/{p['prompts']} "
                     f"prompts identical; first differing position per prompt: {p['first_diff']}")
    errors = [r for r in rows if "error" in r]
    lines += [""] + [f"- {r['variant']} FAILED: `{r['error'][-300:]!r}`" for r in errors]
    lines += [f"- {r['variant']}: {r['warning'][:200]!r}" for r in rows if "warning" in r]
    return {"ratios": ratios, "parity": par}, "\n".join(lines) + "\n"


def write(args, rows: list[dict]) -> None:
    summary, md = summarize(rows, args)
    with open(os.path.join(args.out, "generate_parallel.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k != "child_argv"}, "results": rows, **summary,
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=1)
    with open(os.path.join(args.out, "generate_parallel.md"), "w") as f:
        f.write(md)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/generate-parallel")
    ap.add_argument("--workdir", default="/tmp/fourfold-generate-parallel")
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="engine dtype; float32 makes the greedy parity check free of bf16 near-ties")
    ap.add_argument("--variants", default="tp1,tp2,pp2,pp2one")
    ap.add_argument("--concurrency", default="1,64,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--kv-cache-bytes", type=int, default=256 << 20, help="KV pool on the CPU")
    ap.add_argument("--graphs", default="on", choices=["on", "off"],
                    help="decode CUDA graphs; a 2-rank variant that fails is retried without graphs or fusion")
    ap.add_argument("--engine", default="", help="EngineConfig fields, e.g. look_ahead=false,fused_decoder=false")
    ap.add_argument("--budget-s", type=float, default=520, help="wall time for everything, checkpoint included")
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies the per-variant timeouts")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.one == "write":
        write_model(args)
        return 0
    if args.one:
        run_engine_variant(args, args.one)
        return 0
    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.workdir, exist_ok=True)
    args.child_argv = ["--workdir", args.workdir, "--preset", args.preset, "--device", args.device,
                       "--dtype", args.dtype, "--concurrency", ",".join(map(str, args.concurrency)), "--prompt-len", str(args.prompt_len),
                       "--new-tokens", str(args.new_tokens), "--max-num-seqs", str(args.max_num_seqs),
                       "--max-batched-tokens", str(args.max_batched_tokens),
                       "--kv-cache-bytes", str(args.kv_cache_bytes)]
    rows: list[dict] = []
    for name in ["write", *args.variants.split(",")]:
        left = args.budget_s - (time.perf_counter() - start)
        if left < 20:
            rows.append({"variant": name, "error": "skipped: --budget-s spent"})
            say(f"== {name}: skipped, budget spent")
            continue
        got = launch(args, name, left, args.graphs, args.engine)
        if (name in ("tp2", "pp2", "pp2one") and args.device == "cuda" and got and "error" in got[-1]
                and not any(r.get("kind") == "throughput" for r in got)):
            left = args.budget_s - (time.perf_counter() - start)
            if left > 60:  # the plain engine: eager decode steps, unfused weights
                plain = ",".join(filter(None, [args.engine, "fused_decoder=false"]))
                got = [{**got[-1], "variant": f"{name} (first try)"}, *launch(args, name, left, "off", plain)]
        rows += got
        if name == "write" and got and "error" in got[-1]:
            break
        write(args, rows)
    write(args, rows)
    say("")
    say(open(os.path.join(args.out, "generate_parallel.md")).read())
    say(f"total {time.perf_counter() - start:.0f}s; wrote {args.out}/generate_parallel.json and .md")
    return 0 if not any("error" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
