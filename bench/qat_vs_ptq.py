"""Quantization-aware training vs post-training quantization on a Llama pretrained here (CPU in minutes, or a GPU).

    python bench/qat_vs_ptq.py [--dim 256 --layers 2 --pretrain-steps 500 --finetune-steps 120]
        [--qat-schemes int4-g256,8da4w-g256] [--out bench/results/<date>-cpu-qat] [--plot docs/images/...]
    python bench/qat_vs_ptq.py --device cuda --tokenizer tokenizer.json --corpus python --dim 512 --layers 8 \
        --pretrain-seconds 150 ...          # the GPU run of docs/quantization.md

1. Pretrain a Llama (fourfold.models.llama) on Python source (the standard library, or with --corpus python
   also every site-packages .py file, in a seeded shuffled file order so the held-out tail is a random set of
   files) to the end of a cosine schedule, for --pretrain-steps or as many steps as --pretrain-seconds allows.
2. PTQ (round-to-nearest, fourfold.quant.qat.ptq) of that model for every scheme and group size.
3. bench/qat_common.compare_arms: from the same weights, N more steps on the same batches in full precision
   (the control) and with QAT per scheme; PTQ of the control; recovered = (ppl(PTQ of control) - ppl(QAT)) /
   (ppl(PTQ of control) - ppl(control)), on converted models and on fake-quant ones.
4. Bytes of each converted model on disk (a fourfold checkpoint) and in memory, against bf16.
With --gptq-calibration N, GPTQ (calibrated on N training windows) is one more PTQ arm in steps 2 and 3.

Training is a plain loop (AdamW, cosine, clip 1.0; fp32 weights, bf16 autocast on CUDA) around fourfold's
model, so every arm shares one code path and the same batches; `fourfold train --quant.qat` runs the same
fake-quant modules. Held-out perplexity is fourfold eval's function, in fp32. Writes results.json and
table.md into --out and the plot to --plot (and a copy into --out).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fourfold.config import build_config  # noqa: E402
from fourfold.models.llama import Llama  # noqa: E402
from fourfold.quant.schemes import PRESETS  # noqa: E402
from fourfold.tokenizer import load_tokenizer  # noqa: E402
from fourfold.train.dataset import GlobalBatchSampler, PackedSequences, token_file  # noqa: E402
from qat_common import evaluator, run_experiment, train, write_outputs  # noqa: E402
from qat_report import markdown_tables, plot  # noqa: E402

PTQ_DEFAULT = [n for n in PRESETS if not n.endswith("-fp32")]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--pretrain-steps", type=int, default=500)
    p.add_argument("--pretrain-seconds", type=float, default=0,
                   help="instead of --pretrain-steps: as many steps as fit in this many seconds (timed on a copy)")
    p.add_argument("--finetune-steps", type=int, default=120)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--finetune-seconds", type=float, default=0,
                   help="with --pretrain-seconds: cap each fine-tune arm at about this long (same steps for all)")
    p.add_argument("--finetune-lr", type=float, default=5e-4)
    p.add_argument("--qat-schemes", default="int4-g256,8da4w-g256")
    p.add_argument("--ptq-schemes", default=",".join(PTQ_DEFAULT))
    p.add_argument("--output", action="store_true", help="also quantize the output head (PTQ and QAT alike)")
    p.add_argument("--embeddings", action="store_true", help="also quantize the token embedding")
    p.add_argument("--gptq-calibration", type=int, default=0,
                   help="training windows for GPTQ's calibration; > 0 adds GPTQ of the base and of the control as PTQ arms")
    p.add_argument("--eval-sequences", type=int, default=128)
    p.add_argument("--max-bytes", type=int, default=4_000_000)
    p.add_argument("--data", default=None, help="corpus path (default: see --corpus)")
    p.add_argument("--corpus", choices=("stdlib", "python"), default="stdlib",
                   help="without --data: the standard library's .py files, or those plus every site-packages one")
    p.add_argument("--tokenizer", default="byte", help="'byte' or a Hugging Face tokenizer.json")
    p.add_argument("--cache-dir", default=".cache/fourfold")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (bf16 autocast for training there)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (1 is fastest on a busy machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=f"bench/results/{datetime.date.today()}-cpu-qat")
    p.add_argument("--plot", default="docs/images/quant_ppl_vs_group.png")
    p.add_argument("--from-results", default=None, help="only redo tables and plot of this results.json")
    return p.parse_args()


def python_corpus(cache_dir: str, seed: int) -> str:
    """A directory of links to every .py file of the standard library and site-packages, in a seeded random
    order (names 000000.py, ...), so that the held-out tail of the corpus is a random sample of files."""
    roots = {Path(sysconfig.get_paths()[k]) for k in ("stdlib", "purelib", "platlib")}
    files = sorted({f.resolve() for r in roots if r.is_dir() for f in r.rglob("*.py") if f.is_file()})
    random.Random(seed).shuffle(files)
    folder = Path(cache_dir) / f"python-corpus-{seed}-{len(files)}"
    if not folder.is_dir():
        tmp = folder.with_suffix(".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        for i, f in enumerate(files):
            link = tmp / f"{i:06d}.py"
            if not link.exists():
                link.symlink_to(f)
        tmp.rename(folder)
    return str(folder)


def bench_config(a, vocab_size: int):
    flat = {"model.dim": a.dim, "model.n_layers": a.layers, "model.n_heads": a.heads, "model.n_kv_heads": a.heads // 2,
            "model.ffn_dim": a.ffn, "model.vocab_size": vocab_size, "model.max_seq_len": a.seq,
            "train.seq_len": a.seq, "data.max_bytes": a.max_bytes, "data.cache_dir": a.cache_dir,
            "data.tokenizer": a.tokenizer, "compute.device": "cpu"}
    data = a.data or (python_corpus(a.cache_dir, a.seed) if a.corpus == "python" else None)
    if data:
        flat["data.path"] = data
    return build_config({}, {k: str(v) for k, v in flat.items()})


def title(a) -> str:
    head = ", head quantized too" if a.output else ""
    return (f"{getattr(a, 'device_name', None) or a.device.upper()}: Llama dim {a.dim} x {a.layers} layers pretrained on {a.corpus} source{head}; "
            f"QAT/control {a.finetune_steps} steps")


def step_counts(base, train_set, a, bf16: bool) -> tuple[int, int]:
    """(pretraining steps, fine-tune steps): --pretrain-steps, or the steps that fit in --pretrain-seconds
    (timed over 10 steps of a throwaway copy); --finetune-steps, capped by --finetune-seconds with QAT's
    fake quantization assumed to cost 40% more a step."""
    if a.pretrain_seconds <= 0:
        return a.pretrain_steps, a.finetune_steps
    probe = copy.deepcopy(base)
    train(probe, train_set, GlobalBatchSampler(len(train_set), a.batch, a.seed), 3, a.lr, 1, "probe", bf16=bf16)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.time()
    train(probe, train_set, GlobalBatchSampler(len(train_set), a.batch, a.seed), 10, a.lr, 1, "probe", bf16=bf16)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    per_step = (time.time() - t0) / 10
    del probe
    steps = max(20, int(a.pretrain_seconds / per_step))
    finetune = a.finetune_steps
    if a.finetune_seconds > 0:
        finetune = max(10, min(finetune, int(a.finetune_seconds / (1.4 * per_step))))
    print(f"pretraining: {per_step * 1000:.0f} ms a step -> {steps} steps in {a.pretrain_seconds:.0f}s; "
          f"{finetune} fine-tune steps", flush=True)
    return steps, finetune


def main() -> int:
    a = parse_args()
    if a.from_results:
        results = json.loads(Path(a.from_results).read_text())
        (Path(a.from_results).parent / "table.md").write_text(markdown_tables(results))
        plot(results, Path(a.plot), title(argparse.Namespace(**{**vars(a), **results["config"],
                                                               "device_name": results.get("device_name")})))
        return 0
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    bf16 = device.type == "cuda"
    layers = {"output": a.output, "embeddings": a.embeddings}
    torch.manual_seed(a.seed)
    start = time.time()
    tokenizer = load_tokenizer(a.tokenizer)
    cfg = bench_config(a, 320 if a.tokenizer == "byte" else -(-tokenizer.vocab_size // 64) * 64)
    path = token_file(cfg.data, tokenizer)
    train_set = PackedSequences(path, a.seq, "train", cfg.data.val_fraction)
    val_set = PackedSequences(path, a.seq, "val", cfg.data.val_fraction)
    print(f"corpus: {len(train_set)} training and {len(val_set)} held-out windows of {a.seq} tokens "
          f"({time.time() - start:.0f}s)", flush=True)
    evaluate = evaluator(val_set, tokenizer, sequences=a.eval_sequences, batch=16, device=device)

    base = Llama(cfg.model)
    base.init_weights(a.seed)
    base.to(device)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"model: dim {a.dim}, {a.layers} layers, ffn {a.ffn}: {n_params / 1e6:.2f}M parameters", flush=True)
    steps, a.finetune_steps = step_counts(base, train_set, a, bf16)
    pre_losses = train(base, train_set, GlobalBatchSampler(len(train_set), a.batch, a.seed), steps,
                       a.lr, max(1, steps // 20), "pretrain", bf16=bf16)
    results = {"config": vars(a), "params": n_params, "pretrain_steps_run": steps,
               "pretrain_final_loss": sum(pre_losses[-50:]) / len(pre_losses[-50:]),
               "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "base": {"fp32": evaluate(base)}}
    print(f"base: token ppl {results['base']['fp32']['token_ppl']:.4f}", flush=True)
    run_experiment(base, train_set, evaluate, cfg, results, a, layers=layers, bf16=bf16)
    results["seconds"] = time.time() - start
    write_outputs(results, Path(a.out), a.plot, title(a))
    print(f"wrote {a.out}/results.json and {a.plot} in {results['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
