"""Serving benchmark: `fourfold serve` with chunked prefill on and off, and Hugging Face `transformers serve`,
under Poisson arrivals at several rates, with one client and one workload for all.

    python bench/serve.py --out bench/results/serve [--preset llama-1b] [--rates 2,4,8,16] [--requests 40]
    python bench/serve.py --preset llama3-8b --no-peer --fourfold-args "--tp 2" --model-root /tmp/serve-8b \
        --out bench/results/serve-8b-tp2 --rates 2,6 --requests 24          # 2 GPUs, tensor-parallel server

It builds one random-weight Llama (the preset's shape, bf16) as a Hugging Face directory with a BPE
tokenizer trained here on the Python standard library and a ChatML chat template, imports it with
`fourfold convert`, then for each server: start it, warm it up, run the workload at every rate, stop it.
The long-prompt mix puts `--long-fraction` of prompts at `--long-tokens` tokens. Writes results.json,
results.md (vLLM's metric names: TTFT, TPOT, ITL, E2EL mean/median/P99, throughputs, goodput) and
latency_vs_load.png; capacity is the highest rate whose P99 ITL stays under each target (Sarathi-Serve's
definition with time-between-tokens). The model directories (under --model-root, default --out) are
reused by later runs with the same --preset and --max-len; --servers picks the fourfold servers to run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_workload import make_workload, run_load, summarize  # noqa: E402

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def stdlib_text(limit: int = 6_000_000) -> str:
    parts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        size += len(text)
        if size > limit:
            break
    return "\n".join(parts)


def build_hf_model(out: Path, preset: str, max_len: int) -> list[str]:
    """A random-weight Llama + trained BPE tokenizer + ChatML template as a HF directory; the prompt word list."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from fourfold.models.presets import PRESETS

    p = PRESETS[preset]
    text = stdlib_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=p["vocab_size"], special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    cfg = LlamaConfig(hidden_size=p["dim"], num_hidden_layers=p["n_layers"], num_attention_heads=p["n_heads"],
                      num_key_value_heads=p["n_kv_heads"], intermediate_size=p["ffn_dim"],
                      vocab_size=tok.get_vocab_size(), max_position_embeddings=max_len, rope_theta=p["rope_theta"],
                      eos_token_id=tok.token_to_id("<|im_end|>"), bos_token_id=tok.token_to_id("<|endoftext|>"),
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # 8B: drawn on the GPU, built in bf16
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return prompt_words(text)


def prompt_words(text: str) -> list[str]:
    """The identifiers prompts are made of."""
    return sorted({w for w in text.split() if w.isidentifier() and len(w) < 12})[:20000]


def prepare_models(args, hf_dir: Path, ff_dir: Path) -> list[str]:
    """Build and convert the model, or reuse the pair an earlier run with the same preset and length left in --out."""
    stamp, want = ff_dir.parent / "model-build.json", {"preset": args.preset, "max_len": args.max_len}
    if args.reuse_model and stamp.is_file() and json.loads(stamp.read_text()) == want:
        print(f"== reusing {hf_dir} and {ff_dir} (built for {want})", flush=True)
        return prompt_words(stdlib_text())
    stamp.unlink(missing_ok=True)
    t0 = time.perf_counter()
    words = build_hf_model(hf_dir, args.preset, args.max_len)
    print(f"== built {hf_dir} in {time.perf_counter() - t0:.0f}s", flush=True)
    subprocess.run([sys.executable, "-m", "fourfold", "convert", str(hf_dir), str(ff_dir), "--force"], check=True)
    print(f"== converted to {ff_dir}; {time.perf_counter() - t0:.0f}s in all", flush=True)
    stamp.write_text(json.dumps(want))
    return words


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:  # both servers answer it
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server did not become ready")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def servers(args, hf_dir: Path, ff_dir: Path) -> list[tuple[str, list[str], str]]:
    """(name, command, model id clients send) of every server to measure."""
    ff = [sys.executable, "-m", "fourfold", "serve", "--model", str(ff_dir), "--port", str(args.port),
          "--served-model-name", "bench", "--max-requests", "4096", *args.fourfold_args.split()]
    wanted = args.servers.split(",")
    out = []
    if "chunked" in wanted:
        out.append(("fourfold chunked prefill", [*ff, "--max-num-batched-tokens", str(args.chunk)], "bench"))
    if "chunked-mixed-eager" in wanted:   # as before mixed steps had graphs of their own
        out.append(("fourfold chunked prefill, mixed steps eager",
                    [*ff, "--max-num-batched-tokens", str(args.chunk), "--prefill-graph-seqs", "1"], "bench"))
    if "no-chunking" in wanted:
        out.append(("fourfold no chunking", [*ff, "--no-chunked-prefill"], "bench"))
    if args.peer:
        out.append(("transformers serve (continuous batching)",
                    [str(Path(sys.executable).with_name("transformers")), "serve", str(hf_dir),
                     "--continuous-batching", "--port", str(args.port), "--host", "127.0.0.1", "--dtype", "bfloat16"],
                    str(hf_dir)))
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in results.items():
        rates = [r["rate"] for r in runs if "itl_ms" in r]
        axes[0].plot(rates, [r["itl_ms"]["p99"] for r in runs if "itl_ms" in r], marker="o", label=name)
        axes[1].plot(rates, [r["ttft_ms"]["mean"] for r in runs if "ttft_ms" in r], marker="o", label=name)
    for ax, title in zip(axes, ("P99 inter-token latency (ms)", "mean time to first token (ms)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.set_yscale("log")
        ax.grid(alpha=.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/serve")
    ap.add_argument("--preset", default="llama-1b")
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--rates", default="8,16,32,64")
    ap.add_argument("--requests", type=int, default=120, help="requests per rate")
    ap.add_argument("--long-fraction", type=float, default=0.1)
    ap.add_argument("--long-tokens", type=int, default=6000)
    ap.add_argument("--chunk", type=int, default=2048, help="token budget per step with chunked prefill")
    ap.add_argument("--itl-targets", default="50,200", help="P99 ITL targets (ms) for capacity")
    ap.add_argument("--slo-ttft", type=float, default=2000)
    ap.add_argument("--slo-tpot", type=float, default=100)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--fourfold-args", default="", help="extra flags for fourfold serve")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=120, help="client timeout per request (s)")
    ap.add_argument("--reuse-model", action=argparse.BooleanOptionalAction, default=True,
                    help="reuse the model directories an earlier run with the same --preset/--max-len left in --out")
    ap.add_argument("--model-root", default=None,
                    help="where model-hf/ and model-fourfold/ are built or reused (default: --out)")
    ap.add_argument("--servers", default="chunked,no-chunking",
                    help="which fourfold servers to measure: chunked, chunked-mixed-eager (steps that mix prefill "
                         "and decode run without graphs), no-chunking (the peer follows --peer)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = Path(args.model_root) if args.model_root else out
    models.mkdir(parents=True, exist_ok=True)
    hf_dir, ff_dir = models / "model-hf", models / "model-fourfold"
    words = prepare_models(args, hf_dir, ff_dir)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    sample = " ".join(words[:2000:7])
    per_word = len(tok.encode(sample).ids) / len(sample.split())
    rates = [float(r) for r in args.rates.split(",")]
    url = f"http://127.0.0.1:{args.port}"
    results: dict[str, list[dict]] = {}
    for name, command, model_id in servers(args, hf_dir, ff_dir):
        print(f"== {name}: {' '.join(command)}", flush=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0"}  # NVLink multicast stays off
        proc = subprocess.Popen(command, stdout=sys.stdout, stderr=sys.stderr, env=env)
        runs = results.setdefault(name, [])
        try:
            wait_ready(url, proc, args.startup_timeout)
            warm = make_workload(4, words, 99, 0.0, args.long_tokens, per_word)
            asyncio.run(run_load(url, model_id, warm, 100.0, 99))
            for i, rate in enumerate(rates):
                work = make_workload(args.requests, words, 1000 + i, args.long_fraction, args.long_tokens, per_word)
                extra = {"ignore_eos": True} if name.startswith("fourfold") else {}  # the peer refuses the field
                res, wall = asyncio.run(run_load(url, model_id, work, rate, 1000 + i, args.request_timeout, extra))
                summary = {"rate": rate, **summarize(res, wall, args.slo_ttft, args.slo_tpot)}
                runs.append(summary)
                print(json.dumps(summary), flush=True)
        except Exception as e:  # a peer that does not run here is recorded, not fatal
            runs.append({"error": f"{type(e).__name__}: {e}"})
            print(f"   {name} failed: {e}", flush=True)
        finally:
            stop(proc)
    targets = [float(t) for t in args.itl_targets.split(",")]
    capacity = {name: {f"p99_itl<{t:g}ms": max([r["rate"] for r in runs if "itl_ms" in r and r["failed"] == 0
                                                  and r["itl_ms"]["p99"] <= t] or [0.0]) for t in targets}
                for name, runs in results.items()}
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results, "capacity": capacity},
                                                 indent=1))
    lines = ["| server | rate | done | TTFT mean/med/P99 ms | TPOT mean/P99 ms | ITL mean/P99 ms | E2EL mean ms | "
             "out tok/s | goodput req/s |", "|---|---:|---:|---|---|---|---:|---:|---:|"]
    for name, runs in results.items():
        for r in runs:
            if "itl_ms" not in r:
                lines.append(f"| {name} | — | {r.get('error', '')} |||||||")
                continue
            t, p, i, e = r["ttft_ms"], r["tpot_ms"], r["itl_ms"], r["e2el_ms"]
            lines.append(f"| {name} | {r['rate']:g} | {r['completed']}/{r['completed'] + r['failed']} | "
                         f"{t['mean']:.0f}/{t['median']:.0f}/{t['p99']:.0f} | {p['mean']:.1f}/{p['p99']:.1f} | "
                         f"{i['mean']:.1f}/{i['p99']:.1f} | {e['mean']:.0f} | {r['output_throughput']:.0f} | "
                         f"{r['goodput']:.2f} |")
    lines += ["", "capacity (highest rate with P99 ITL under the target): " + json.dumps(capacity)]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, out / "latency_vs_load.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
