"""Generation speed: fourfold's engine vs three Hugging Face peers, same prompts, same GPU, one run.

    python bench/generate.py --out bench/results/generate-h200 --quick            # ~6-8 min on one H200
    python bench/generate.py --out DIR --variants fourfold,hf-compile --profile
    python bench/generate.py --out DIR --variants fourfold,fourfold-quant --quant int4-g128 --concurrency 1

Model: the `llama-1b` preset (1.1B, TinyLlama shape) in bf16 with random weights; prompts of 128 random
token ids, 256 new tokens, greedy, end-of-sequence ignored. Variants, each in its own process:
  fourfold         the engine (`LLM(dir).generate`) at 1, 8, 32, 64, 256 concurrent requests, loading a
                   checkpoint this script writes once (save_checkpoint); decode CUDA graphs are wired
                   onto the runner here unless the engine already has them (--graphs off: eager)
  fourfold-quant   the engine on the same random model converted with fourfold.quant (`ptq`, round to
                   nearest, scheme --quant, e.g. int4-g128; int4-g128+head: the output head too) and
                   saved as a converted checkpoint, loaded
                   the way `fourfold generate` loads one; same concurrencies as fourfold
  fourfold-prefix  64 requests sharing a 1k-token system prompt (--system-len), prefix caching on and off
  hf-eager         `generate` (dynamic cache) at 1 and 64
  hf-compile       `generate` with the static cache, which Hugging Face compiles; two warm-up runs per size
  hf-compile-int4  the same with the decoder's linears on torch's int4 kernel (tinygemm, bench/hf_int4.py),
                   round to nearest at the group size of --quant: the int4 peer of fourfold-quant
  hf-cb            continuous batching `generate_batch` with attn_implementation "paged|sdpa"
Throughput is end to end (prefill included): generated tokens / wall time of the whole batch. Batch-1
decode ms/step comes from two runs (256 and 32 new tokens) and is shown next to the bandwidth bound
(weight bytes / --bandwidth). --quick gives the Hugging Face peers 64 new tokens instead of 256 (their
per-step time barely depends on it) and keeps the whole run near 8 minutes; --profile writes a
torch.profiler table of fourfold decode steps at batch 1 and 64. Writes generate.json and generate.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path[:0] = [ROOT, BENCH]

from common import read_child  # noqa: E402

ORDER = ["fourfold", "fourfold-quant", "hf-compile", "hf-compile-int4", "hf-cb", "hf-eager", "fourfold-prefix"]
TIMEOUTS = {"fourfold": 300, "fourfold-quant": 300, "hf-compile": 330, "hf-compile-int4": 330, "hf-cb": 200,
            "hf-eager": 150, "fourfold-prefix": 200}
HF_CONCURRENCY = {"hf-eager": [1, 64], "hf-compile": [1, 64, 256], "hf-compile-int4": [1, 8, 64], "hf-cb": [1, 64, 256]}
GOALS = {1: 950, 64: 35_000, 256: 75_000}


def say(*parts) -> None:
    print(*parts, flush=True)


def report(row: dict) -> None:
    say("RESULT " + json.dumps(row))


def prompts_for(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()


def preset_vocab(args) -> int:
    from fourfold.models.presets import PRESETS

    return PRESETS[args.preset]["vocab_size"]


# ---------------------------------------------------------------- fourfold side

def model_dir(args, quant: str | None = None):
    """A checkpoint of the preset with random weights (bf16), written once into --workdir; with `quant`
    the same kind of model converted by fourfold.quant.ptq (round to nearest) into that scheme."""
    import torch

    from fourfold.checkpoint.store import latest_checkpoint, save_checkpoint
    from fourfold.config import build_config
    from fourfold.models.llama import Llama
    from fourfold.quant.qat import ptq, quant_meta

    run_dir = os.path.join(args.workdir, f"model-{args.preset}" + (f"-{quant}" if quant else ""))
    if latest_checkpoint(run_dir) is None:
        t0 = time.perf_counter()
        cfg = build_config({"model": {"preset": args.preset}})
        torch.manual_seed(0)
        with torch.device(args.device):
            model = Llama(cfg.model).to(torch.bfloat16)
        meta = {"step": 0, "config": cfg.to_dict(), "tokenizer": "byte"}
        if quant:  # "SCHEME" or "SCHEME+head": the output head quantized too
            scheme, _, extra = quant.partition("+")
            ptq(model, scheme, output=extra == "head")
            meta["quant"] = quant_meta(model)
        save_checkpoint(run_dir, 0, model, None, meta, keep=1, writer=True)
        del model
        say(f"PROGRESS wrote random-weight checkpoint {run_dir} in {time.perf_counter() - t0:.1f}s")
    return run_dir


def wire_decode_graphs(llm, args) -> str:
    """Put fourfold.infer.cuda_graphs.DecodeGraphs in front of the runner's forward, unless it has graphs."""
    runner = llm.engine.runner
    if args.graphs == "off" or args.device != "cuda":
        return "eager"
    if getattr(runner, "graphs", None) is not None:
        return "engine's graphs"
    from fourfold.infer.cuda_graphs import DecodeGraphs
    from fourfold.infer.step_tensors import StepTensors

    max_len = getattr(llm.engine, "max_model_len", 2048)
    pool = runner.pool
    graphs = DecodeGraphs(lambda *t: runner.decode_forward(StepTensors(*t)), max_batch=args.max_num_seqs,
                          max_blocks=-(-max_len // pool.block_size), block_size=pool.block_size,
                          scratch_block=pool.scratch_block, device=llm.engine.runner.device,
                          compile=args.compile_decode)
    t0 = time.perf_counter()
    graphs.capture()
    say(f"PROGRESS captured decode graphs for {graphs.sizes} in {time.perf_counter() - t0:.1f}s")
    eager = runner.forward

    def forward(st):
        return graphs.run(st).float() if graphs.can_run(st) else eager(st)

    runner.forward = forward
    runner.bench_graphs = graphs
    return "bench-wired DecodeGraphs" + (" + compile" if args.compile_decode else "")


def decode_ms_per_step(llm, args, vocab: int, long_elapsed: float | None = None) -> float:
    """Decode time per step at one sequence without the prefill: the difference of a long and a short run
    (`long_elapsed`: a long run already timed, else one is run here)."""
    if long_elapsed is None:
        long_elapsed, _ = timed_generate(llm, prompts_for(1, args.prompt_len, vocab, seed=1), args.new_tokens)
    short, _ = timed_generate(llm, prompts_for(1, args.prompt_len, vocab, seed=5), 32)
    return 1000 * (long_elapsed - short) / (args.new_tokens - 32)


def set_decode_shortcuts(llm, on: bool) -> None:
    """Turn the runner's decode shortcuts (inputs staged into the graph buffers, the graph's own argmax) off
    (each decode step's uploads copied into the buffers, float32 logits to the sampler) or back on."""
    runner = llm.engine.runner
    graphs = getattr(runner, "graphs", None)
    for owner, name, off in ((graphs, "stage", lambda *a: None), (runner, "forward_greedy", lambda st: None)):
        if owner is None:
            continue
        if on:
            owner.__dict__.pop(name, None)
        else:
            setattr(owner, name, off)


def graph_replay_ms(llm, replays: int = 200) -> float | None:
    """Device time of the captured one-sequence decode graph alone, replayed back to back (its static inputs hold
    the last step's, so each replay rewrites the same KV slot with the same values); None without graphs."""
    import torch

    graphs = getattr(llm.engine.runner, "graphs", None) or getattr(llm.engine.runner, "bench_graphs", None)
    graph = getattr(graphs, "graphs", {}).get(1) if graphs is not None else None
    if graph is None:
        return None
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def timed_generate(llm, prompts, max_tokens) -> tuple[float, int]:
    import torch

    from fourfold.infer.requests import SamplingParams

    # ids only, like the Hugging Face peers (their generate returns token ids, no text)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, progress=False)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return time.perf_counter() - t0, sum(len(r.token_ids) for r in results)


def build_llm(args, quant: str | None = None, **config):
    import torch

    from fourfold.infer.llm import LLM

    t0 = time.perf_counter()
    if getattr(args, "prefill_graph_tokens", None) is not None:
        config.setdefault("prefill_graph_tokens", args.prefill_graph_tokens)
    llm = LLM(model_dir(args, quant), device=args.device, dtype=torch.bfloat16, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_batched_tokens, **config)
    say(f"PROGRESS engine ready in {time.perf_counter() - t0:.1f}s")
    return llm


def run_fourfold(args, quant: str | None = None) -> None:
    from fourfold.infer import gemv_gpu
    from fourfold.infer import fused_decoder
    from fourfold.quant import int4_gemv

    variant = f"fourfold-{quant}" if quant else "fourfold"
    if args.gemv_rows is not None:  # A/B switches: 0 sends every step to cuBLAS / torch's int4 kernel
        gemv_gpu.MAX_ROWS = args.gemv_rows
    if args.int4_gemv_rows is not None:
        int4_gemv.MAX_ROWS = args.int4_gemv_rows
    if args.int4_fused_norms is not None:
        fused_decoder.INT4_FUSED_NORMS = bool(args.int4_fused_norms)
    llm = build_llm(args, quant, fused_decoder=not args.no_fused, overlap_steps=not args.no_overlap,
                    look_ahead=not args.no_look_ahead)
    path = wire_decode_graphs(llm, args)
    if args.decode_shortcuts == "off":
        set_decode_shortcuts(llm, False)
        path += ", no decode shortcuts"
    vocab = preset_vocab(args)
    for c in args.concurrency:
        timed_generate(llm, prompts_for(c, args.prompt_len, vocab, seed=10_000 + c), 4)  # warm-up, other prompts
        elapsed, tokens = timed_generate(llm, prompts_for(c, args.prompt_len, vocab, seed=c), args.new_tokens)
        row = {"variant": variant, "concurrency": c, "tokens": tokens, "seconds": elapsed,
               "tokens_per_s": tokens / elapsed, "decode_path": path}
        if c == 1:
            # three figures, each from a long and a short request of its own: the process's first long request (the
            # timed one above) can carry one-off costs (seventeenth session, docs/benchmarks.md), shown apart
            runs = [decode_ms_per_step(llm, args, vocab) for _ in range(3)]
            row["ms_per_step"], row["ms_per_step_runs"] = sorted(runs)[1], runs
            row["first_request_ms_per_step"] = decode_ms_per_step(llm, args, vocab, elapsed)
            if args.decode_shortcuts == "ab":  # the same engine, shortcuts off then on, three times each
                off, on = [], []
                for _ in range(3):
                    set_decode_shortcuts(llm, False)
                    off.append(decode_ms_per_step(llm, args, vocab))
                    set_decode_shortcuts(llm, True)
                    on.append(decode_ms_per_step(llm, args, vocab))
                row["ab_ms_per_step_shortcuts_off"], row["ab_ms_per_step_shortcuts_on"] = off, on
            graph_ms = graph_replay_ms(llm)
            if graph_ms is not None:  # the rest of a step: inputs, sampling, read-back and the gaps around them
                row["graph_ms_per_step"] = graph_ms
        report(row)
    if args.profile:
        try:
            profile_decode(llm, args, vocab, variant)
        except Exception as e:  # the timings above are already reported
            say(f"PROGRESS decode profile failed: {e!r}")


def kernel_summary(prof, steps: int) -> str:
    """Per-kernel lines of a profile: calls and device microseconds per step, by total time; then the sum of the
    kernel times and the span from the first kernel's start to the last one's end, per step."""
    from collections import defaultdict

    from torch.autograd import DeviceType

    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not kernels:
        return "no device events recorded\n"
    calls, total = defaultdict(int), defaultdict(float)
    for e in kernels:
        calls[e.name] += 1
        total[e.name] += e.time_range.elapsed_us()
    span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    lines = [f"{'kernel':70s} {'calls/step':>10s} {'us/step':>9s} {'us/call':>8s}"]
    for name in sorted(total, key=total.get, reverse=True):
        lines.append(f"{name[:70]:70s} {calls[name] / steps:10.1f} {total[name] / steps:9.1f} "
                     f"{total[name] / calls[name]:8.2f}")
    lines.append(f"kernel time {sum(total.values()) / steps:.1f} us/step, span {span / steps:.1f} us/step, "
                 f"{len(kernels) / steps:.0f} kernels/step")
    return "\n".join(lines) + "\n"


def steady_decode_summary(engine, prompts, params, tag: str, steps: int = 5) -> str:
    """kernel_summary of `steps` engine steps once `prompts` (requests tag-0, tag-1, ...) decode together: after 8
    steps of prefill and settling; the requests then run to the end."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    summary = kernel_summary(prof, steps)
    while engine.has_unfinished():
        engine.step()
    return summary


def profile_decode(llm, args, vocab, variant: str) -> None:
    """Where five decode steps' device time goes at each --profile-batches size: kernel_summary, written to --out
    (one file per variant and batch)."""
    from fourfold.infer.requests import SamplingParams

    for batch in args.profile_batches:
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        prompts = prompts_for(batch, args.prompt_len, vocab, seed=777 + batch)
        summary = steady_decode_summary(llm.engine, prompts, params, f"profile-{batch}")
        name = f"decode_profile_{variant}_b{batch}.txt"
        with open(os.path.join(args.out, name), "w") as f:
            f.write(f"{variant} decode, batch {batch}, 5 engine steps (sampling and scheduling included)\n")
            f.write(summary)
        say(f"PROGRESS wrote {name}")


def run_fourfold_prefix(args) -> None:
    system = prompts_for(1, args.system_len, preset_vocab(args), seed=99)[0]
    for caching in (True, False):
        llm = build_llm(args, enable_prefix_caching=caching)
        wire_decode_graphs(llm, args)
        vocab = preset_vocab(args)
        timed_generate(llm, [system + prompts_for(1, args.prompt_len, vocab, seed=1)[0]], 2)  # the cache holds it
        prompts = [system + p for p in prompts_for(64, args.prompt_len, vocab, seed=64)]
        elapsed, tokens = timed_generate(llm, prompts, args.new_tokens)
        report({"variant": f"fourfold-prefix-{'on' if caching else 'off'}", "concurrency": 64, "tokens": tokens,
                "seconds": elapsed, "tokens_per_s": tokens / elapsed, "prompt_len": len(prompts[0])})
        llm.close()


# ---------------------------------------------------------------- Hugging Face side

def hf_model(args, attn: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fourfold.models.presets import PRESETS

    p = PRESETS[args.preset]
    config = LlamaConfig(vocab_size=p["vocab_size"], hidden_size=p["dim"], intermediate_size=p["ffn_dim"],
                         num_hidden_layers=p["n_layers"], num_attention_heads=p["n_heads"],
                         num_key_value_heads=p["n_kv_heads"], max_position_embeddings=p["max_seq_len"],
                         rope_theta=p["rope_theta"], rms_norm_eps=1e-5, tie_word_embeddings=False)
    with torch.device(args.device):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation=attn)
    return model.eval(), p["vocab_size"]


def run_hf(args) -> None:
    import torch

    name = args.one
    new = args.hf_new_tokens
    attn = args.hf_cb_attn if name == "hf-cb" else "sdpa"
    try:
        model, vocab = hf_model(args, attn)
        if name == "hf-compile-int4":
            from hf_int4 import quantize_decoder_linears

            scheme = re.fullmatch(r"int4-g(\d+)(\+head)?", args.quant)
            if scheme is None:
                raise SystemExit(f"hf-compile-int4 runs int4-gN schemes only (torch's int4 kernel), not {args.quant!r}")
            group = int(scheme.group(1))
            say(f"PROGRESS {quantize_decoder_linears(model, group)} decoder linears on torch's int4 kernel, group {group}")
    except Exception as e:  # an older/newer transformers may not know the paged name: fall back, and say so
        if name != "hf-cb":
            raise
        say(f"PROGRESS attn_implementation {attn!r} failed ({e}); using 'sdpa'")
        attn = "sdpa"
        model, vocab = hf_model(args, attn)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    compiled = name in ("hf-compile", "hf-compile-int4")
    if compiled:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = 64
    for c in HF_CONCURRENCY[name]:
        if c not in args.concurrency and c != 1:
            continue
        prompts = prompts_for(c, args.prompt_len, vocab, seed=c)
        if name == "hf-cb":
            from transformers import GenerationConfig

            gen_cfg = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)

            def go(ps, n=new):
                gen_cfg.max_new_tokens = n
                out = model.generate_batch(inputs=ps, generation_config=gen_cfg)
                return sum(len(o.generated_tokens) for o in out.values())
        else:
            extra = {"cache_implementation": "static"} if compiled else {}

            def go(ps, n=new):
                ids = torch.tensor(ps, device=args.device)
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, pad_token_id=0, **extra)
                return (out.shape[1] - ids.shape[1]) * ids.shape[0]
        warmups = 2 if compiled else 1
        t0 = time.perf_counter()  # no inference_mode: generate_batch refuses it; both run under no_grad
        for w in range(warmups):  # other prompts, same shapes
            go(prompts_for(c, args.prompt_len, vocab, seed=10_000 + c + w))
        say(f"PROGRESS {name} c={c}: warm-up {time.perf_counter() - t0:.1f}s")
        sync()
        t0 = time.perf_counter()
        tokens = go(prompts)
        sync()
        elapsed = time.perf_counter() - t0
        report({"variant": name, "concurrency": c, "tokens": tokens, "seconds": elapsed,
                "tokens_per_s": tokens / elapsed, "ms_per_step": 1000 * elapsed / new, "new_tokens": new,
                "attn_implementation": attn})


# ---------------------------------------------------------------- parent: run, collect, write

def run_variant(name: str, args, budget_left: float) -> list[dict]:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name, *args.child_argv]
    timeout = max(30.0, min(TIMEOUTS[name], budget_left))
    say(f"== {name} (timeout {timeout:.0f}s)")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)

    def show(row: dict) -> None:
        say(f"   {row['variant']:22s} c={row['concurrency']:<4d} {row['tokens_per_s']:10,.0f} tok/s"
            + (f"  {row['ms_per_step']:.3f} ms/step" if "ms_per_step" in row else "")
            + (f" (graph alone {row['graph_ms_per_step']:.3f})" if "graph_ms_per_step" in row else "")
            + (f" runs {[round(v, 3) for v in row['ms_per_step_runs']]}" if "ms_per_step_runs" in row else "")
            + (f", from the first request {row['first_request_ms_per_step']:.3f}" if "first_request_ms_per_step" in row
               else "")
            + (f"\n     shortcuts off {[round(v, 3) for v in row['ab_ms_per_step_shortcuts_off']]}, on "
               f"{[round(v, 3) for v in row['ab_ms_per_step_shortcuts_on']]}" if "ab_ms_per_step_shortcuts_on" in row
               else ""))

    rows, tail = read_child(proc, name, timeout, proc.kill, show, say)
    if proc.returncode not in (0, None) and not any("error" in r for r in rows):
        rows.append({"variant": name, "error": "\n".join(tail[-25:])})
    if any("error" in r for r in rows):
        say("   FAILED: " + rows[-1]["error"][-1500:])
    return rows


def markdown(rows: list[dict], args, bound_ms: float) -> str:
    ok = [r for r in rows if "error" not in r]
    cols = sorted({r["concurrency"] for r in ok})
    names = [n for n in ["fourfold", f"fourfold-{args.quant}", "hf-eager", "hf-compile", "hf-compile-int4", "hf-cb",
                         "fourfold-prefix-on", "fourfold-prefix-off"]
             if any(r["variant"] == n for r in ok)]
    cell = {(r["variant"], r["concurrency"]): r for r in ok}
    lines = [f"`{args.preset}` bf16, random weights, prompt {args.prompt_len}, {args.new_tokens} new tokens "
             f"(HF peers: {args.hf_new_tokens}), greedy; tokens/s end to end.", "",
             "| engine | " + " | ".join(str(c) for c in cols) + " | ms/step at 1 |", "|---|" + "---:|" * (len(cols) + 1)]
    for n in names:
        vals = [f"{cell[(n, c)]['tokens_per_s']:,.0f}" if (n, c) in cell else "—" for c in cols]
        ms = cell.get((n, 1), {}).get("ms_per_step")
        lines.append(f"| {n} | " + " | ".join(vals) + f" | {ms:.3f} |" if ms else f"| {n} | " + " | ".join(vals) + " | — |")
    peers = ["hf-eager", "hf-compile", "hf-cb"]
    ratio = []
    for c in cols:
        best = max((cell[(p, c)]["tokens_per_s"] for p in peers if (p, c) in cell), default=None)
        ratio.append(f"{cell[('fourfold', c)]['tokens_per_s'] / best:.2f}x" if best and ("fourfold", c) in cell else "—")
    lines.append("| fourfold / best HF | " + " | ".join(ratio) + " | |")
    quant = f"fourfold-{args.quant}"
    if any(r["variant"] == quant for r in ok):
        q_ratio = [f"{cell[(quant, c)]['tokens_per_s'] / cell[('fourfold', c)]['tokens_per_s']:.2f}x"
                   if (quant, c) in cell and ("fourfold", c) in cell else "—" for c in cols]
        lines.append(f"| {quant} / fourfold bf16 | " + " | ".join(q_ratio) + " | |")
        peer = [f"{cell[(quant, c)]['tokens_per_s'] / cell[('hf-compile-int4', c)]['tokens_per_s']:.2f}x"
                if (quant, c) in cell and ("hf-compile-int4", c) in cell else "—" for c in cols]
        if any(v != "—" for v in peer):
            lines.append(f"| {quant} / hf-compile-int4 | " + " | ".join(peer) + " | |")
    lines += ["", f"Bandwidth bound at batch 1: {bound_ms:.3f} ms/step ({1000 / bound_ms:,.0f} tok/s) = weight bytes / "
              f"{args.bandwidth / 1e12:.2f} TB/s."]
    for c, goal in GOALS.items():  # the engine issue's goals, set for llama-1b
        if args.preset == "llama-1b" and ("fourfold", c) in cell:
            got = cell[("fourfold", c)]["tokens_per_s"]
            lines.append(f"Goal at {c}: >= {goal:,} tok/s; measured {got:,.0f} ({'met' if got >= goal else 'not met'}).")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(BENCH, "results", "generate"))
    ap.add_argument("--workdir", default="/tmp/fourfold-bench-generate", help="where the checkpoint is written")
    ap.add_argument("--variants", default=",".join(v for v in ORDER if v != "fourfold-quant"))
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", default="1,8,32,64,256")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--system-len", type=int, default=1024, help="shared system prompt of fourfold-prefix")
    ap.add_argument("--hf-new-tokens", type=int, default=None, help="default: --new-tokens, 64 with --quick")
    ap.add_argument("--hf-cb-attn", default="paged|sdpa")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batched-tokens", type=int, default=4096)
    ap.add_argument("--prefill-graph-tokens", type=int, default=None,
                    help="fourfold: EngineConfig.prefill_graph_tokens (default: the engine's; 0: no prefill graphs)")
    ap.add_argument("--graphs", choices=["auto", "off"], default="auto")
    ap.add_argument("--compile-decode", action="store_true", help="torch.compile the decode forward before capture")
    ap.add_argument("--profile", action="store_true", help="write a per-kernel summary of decode steps")
    ap.add_argument("--profile-batches", default="1,64", help="--profile: batch sizes to profile")
    ap.add_argument("--no-fused", action="store_true", help="fourfold: the model's own forward (no fused decoder)")
    ap.add_argument("--no-overlap", action="store_true", help="fourfold: read each step's tokens before returning")
    ap.add_argument("--no-look-ahead", action="store_true", help="fourfold: overlap output building only")
    ap.add_argument("--decode-shortcuts", choices=["on", "off", "ab"], default="on",
                    help="fourfold: decode steps with staged graph inputs and the graph's own argmax (on), without "
                    "(off), or both at one sequence, alternating on the same engine (ab)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-s", type=float, default=480, help="total wall time for all variants")
    ap.add_argument("--bandwidth", type=float, default=4.26e12, help="GPU memory bandwidth, bytes/s (H200)")
    ap.add_argument("--gemv-rows", type=int, default=None, help="fourfold: Triton bf16 GEMV up to this many "
                    "tokens (default: fourfold.infer.gemv_gpu.MAX_ROWS; 0: cuBLAS only)")
    ap.add_argument("--int4-gemv-rows", type=int, default=None, help="fourfold-quant: Triton int4 GEMV up to this "
                    "many tokens (default: fourfold.quant.int4_gemv.MAX_ROWS; 0: torch's _weight_int4pack_mm only)")
    ap.add_argument("--int4-fused-norms", type=int, choices=(0, 1), default=None, help="fourfold-quant: 0 runs "
                    "separate add+RMSNorm kernels at decode instead of fusing them into the int4 GEMVs (the default)")
    ap.add_argument("--quant", default="int4-g128", help="scheme of the fourfold-quant variant (fourfold.quant); "
                    "SCHEME+head quantizes the output head too")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    args.profile_batches = [int(c) for c in str(args.profile_batches).split(",")]
    if args.hf_new_tokens is None:
        args.hf_new_tokens = 64 if args.quick else args.new_tokens
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.workdir, exist_ok=True)
    if args.one:
        if args.one == "fourfold-quant":
            run_fourfold(args, args.quant)
        else:
            {"fourfold": run_fourfold, "fourfold-prefix": run_fourfold_prefix}.get(args.one, run_hf)(args)
        return 0
    from fourfold.config import build_config
    from fourfold.models.llama import parameter_counts

    total_params, _ = parameter_counts(build_config({"model": {"preset": args.preset}}).model)
    bound_ms = 1000 * total_params * 2 / args.bandwidth
    args.child_argv = [a for a in sys.argv[1:]]
    start, rows = time.perf_counter(), []
    for name in [v for v in ORDER if v in args.variants.split(",")]:
        left = args.budget_s - (time.perf_counter() - start)
        if left < 30:
            rows.append({"variant": name, "error": "skipped: out of --budget-s"})
            continue
        rows += run_variant(name, args, left)
        with open(os.path.join(args.out, "generate.json"), "w") as f:  # after every variant: a crash keeps the rest
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "child_argv"}, "bound_ms_per_step": bound_ms,
                       "rows": rows}, f, indent=2)
        with open(os.path.join(args.out, "generate.md"), "w") as f:
            f.write(markdown(rows, args, bound_ms))
    say("\n" + markdown(rows, args, bound_ms))
    say(f"total {time.perf_counter() - start:.0f}s; wrote {args.out}/generate.json and generate.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
