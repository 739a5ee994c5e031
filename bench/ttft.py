"""Time to first token at one sequence: fourfold's engine with and without prefill graphs, and Hugging Face.

    python bench/ttft.py --out DIR [--prompt-lens 16,128,512,1024] [--repeats 7] [--quant int4-g128]
                         [--prefill-graph-tokens N]

Models: the `llama-1b` preset with random weights in bf16, and the same model converted by fourfold.quant
(bench/generate.py's checkpoints). For each prompt length, `--repeats` different random prompts, one request at
a time, greedy: the engine's time from add_request to the first token's output (`ttft_ms`; with overlapped steps
an output arrives one step after its token is computed, as a caller sees it) and the prefill step's own wall
time (`prefill_ms`: the first engine.step, synchronized). Each engine runs every prompt twice, prefill graphs on
(the default: fourfold.infer.prefill_graphs) and off (eager prefill, what it did before), and checks the two give
the same first token. Peer: Hugging Face `transformers` (sdpa, bf16; its int4 model with the decoder linears on
torch's int4 kernel, bench/hf_int4.py), one forward over the prompt and the argmax of the last logits,
synchronized: its time to first token without any engine around it. Medians over the repeats. Writes ttft.json
and ttft.md to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import generate as gen  # noqa: E402

from fourfold.infer.requests import SamplingParams  # noqa: E402


def first_token(engine, prompt: list[int]) -> tuple[float, float, int]:
    """(ms to the first token's output, ms of the first step, that token) of one greedy request run to its end; the
    engine must compute the whole prompt (its prefix cache is off: the same prompts run once per path)."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.add_request(f"ttft-{time.monotonic_ns()}", prompt, params)
    outs = engine.step()
    torch.cuda.synchronize()
    prefill = time.perf_counter() - t0
    while not any(o.token_ids for o in outs):
        outs = engine.step()
    ttft = time.perf_counter() - t0
    token = next(o.token_ids[0] for o in outs if o.token_ids)
    cached = sum(o.cached_prompt_tokens for o in outs if o.finished)
    while engine.has_unfinished():
        cached += sum(o.cached_prompt_tokens for o in engine.step() if o.finished)
    if cached:
        raise RuntimeError(f"{cached} prompt tokens came from the prefix cache: the prefill was not timed whole")
    return 1000 * ttft, 1000 * prefill, token


def fourfold_rows(args, quant: str | None, vocab: int) -> list[dict]:
    # args.prefill_graph_tokens: the engine's setting when given. No prefix cache: each path runs the same prompts,
    # and the second would otherwise find them cached (runs before this fix timed the eager path on cached prompts)
    llm = gen.build_llm(args, quant, enable_prefix_caching=False)
    engine, runner = llm.engine, llm.engine.runner
    graphs = runner.prefill_graphs
    gen.say(f"PROGRESS prefill graphs at {graphs.sizes if graphs else None}")
    rows = []
    for length in args.prompt_lens:
        prompts = [gen.prompts_for(1, length, vocab, seed=1000 * length + i)[0] for i in range(args.repeats)]
        first_token(engine, gen.prompts_for(1, length, vocab, seed=7)[0])   # warm-up: kernels for this shape
        timed = {}
        for label, on in (("graphs", graphs), ("eager", None)):
            runner.prefill_graphs = on
            first_token(engine, gen.prompts_for(1, length, vocab, seed=8)[0])
            timed[label] = [first_token(engine, p) for p in prompts]
        runner.prefill_graphs = graphs
        row = {"model": quant or "bf16", "prompt_len": length,
               "same_first_token": sum(a[2] == b[2] for a, b in zip(timed["graphs"], timed["eager"])),
               "prompts": len(prompts)}
        for label, runs in timed.items():
            row[f"ttft_ms_{label}"] = statistics.median(r[0] for r in runs)
            row[f"prefill_ms_{label}"] = statistics.median(r[1] for r in runs)
        rows.append(row)
        gen.say(f"RESULT {json.dumps(row)}")
    del engine, runner, graphs
    llm.close()   # the engine's memory back before the peer loads (a dropped engine stays frozen until the next build)
    return rows


@torch.inference_mode()
def hf_rows(args, quant: str | None) -> list[dict]:
    model, vocab = gen.hf_model(args, "sdpa")
    if quant:
        from hf_int4 import quantize_decoder_linears

        quantize_decoder_linears(model, int(quant.split("-g")[1].split("+")[0]))
    rows = []
    for length in args.prompt_lens:
        prompts = [gen.prompts_for(1, length, vocab, seed=1000 * length + i)[0] for i in range(args.repeats)]
        times = []
        for i, p in enumerate([prompts[0]] * 2 + prompts):   # two warm-ups
            ids = torch.tensor([p], device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(ids).logits[0, -1].argmax().item()
            if i >= 2:
                times.append(1000 * (time.perf_counter() - t0))
        row = {"model": f"hf-{quant or 'bf16'}", "prompt_len": length, "ttft_ms": statistics.median(times)}
        rows.append(row)
        gen.say(f"RESULT {json.dumps(row)}")
    del model
    torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], args) -> str:
    hf = {(r["model"][3:], r["prompt_len"]): r["ttft_ms"] for r in rows if r["model"].startswith("hf-")}
    lines = [f"`{args.preset}`, random weights, one sequence, {torch.cuda.get_device_name()}; medians of "
             f"{args.repeats} prompts (ms)", "",
             "| model | prompt | fourfold TTFT, graphs / eager | prefill step, graphs / eager | eager / graphs | "
             "Hugging Face forward | HF / fourfold | same first token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["model"].startswith("hf-"):
            continue
        peer = hf.get((r["model"], r["prompt_len"]))
        lines.append(f"| {r['model']} | {r['prompt_len']} | {r['ttft_ms_graphs']:.2f} / {r['ttft_ms_eager']:.2f} | "
                     f"{r['prefill_ms_graphs']:.2f} / {r['prefill_ms_eager']:.2f} | "
                     f"{r['ttft_ms_eager'] / r['ttft_ms_graphs']:.2f}x | "
                     f"{peer:.2f} | {peer / r['ttft_ms_graphs']:.2f}x | {r['same_first_token']}/{r['prompts']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/ttft")
    ap.add_argument("--prompt-lens", default="16,128,512,1024")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quant", default="int4-g128", help="scheme of the converted model ('' for bf16 only)")
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--workdir", default="/tmp/fourfold-bench-generate")
    ap.add_argument("--prefill-graph-tokens", type=int, default=None,
                    help="EngineConfig.prefill_graph_tokens (default: the engine's)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    args = argparse.Namespace(workdir=a.workdir, preset=a.preset, device="cuda", max_num_seqs=256,
                              max_batched_tokens=4096, prompt_lens=[int(n) for n in a.prompt_lens.split(",")],
                              repeats=a.repeats, prefill_graph_tokens=a.prefill_graph_tokens)
    vocab = gen.preset_vocab(args)
    rows = []
    for quant in [None] + ([a.quant] if a.quant else []):
        rows += fourfold_rows(args, quant, vocab)
        rows += hf_rows(args, quant)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ttft.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    (out / "ttft.md").write_text(markdown(rows, args))
    print(markdown(rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
