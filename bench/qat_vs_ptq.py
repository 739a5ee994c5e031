"""Quantization-aware training vs post-training quantization on one small Llama, all on the CPU in minutes.

    python bench/qat_vs_ptq.py [--dim 256 --layers 4 --pretrain-steps 1000 --finetune-steps 200]
        [--qat-schemes int4-g256,8da4w-g256,...] [--out bench/results/<date>-cpu-qat] [--plot docs/images/...]

1. Pretrain a Llama (fourfold.models.llama) on the Python standard library's source (byte tokens) to
   the end of a cosine schedule; evaluate held-out token/word perplexity (fourfold eval's function).
2. PTQ (round-to-nearest, fourfold.quant.qat.ptq) of that model for every scheme and group size.
3. From the same pretrained weights, N more steps on the same batches three ways: full precision (the
   control) and QAT per scheme. Each QAT model is converted to packed int4/int8 modules and evaluated
   converted; the control is evaluated in full precision and PTQ'd with each scheme.
4. Recovered = (ppl(PTQ of control) - ppl(QAT, converted)) / (ppl(PTQ of control) - ppl(control)): the
   fraction of PTQ's degradation that QAT wins back, against a baseline with the same total training.
5. Bytes of each converted model on disk (a fourfold checkpoint: safetensors + meta.json) and in memory,
   against the same model in bf16.

Training uses a plain loop (AdamW, cosine, clip 1.0, fp32) around fourfold's model, so every arm shares
one code path and the same batches; `fourfold train --quant.qat` runs the same fake-quant modules.
Writes results.json into --out and the plot to --plot.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fourfold.checkpoint.store import save_checkpoint  # noqa: E402
from fourfold.cli.eval import perplexity  # noqa: E402
from fourfold.config import build_config  # noqa: E402
from fourfold.models.llama import Llama  # noqa: E402
from fourfold.quant.qat import convert, prepare_qat, ptq, quant_meta  # noqa: E402
from fourfold.quant.schemes import PRESETS  # noqa: E402
from fourfold.tokenizer import load_tokenizer  # noqa: E402
from fourfold.train.dataset import GlobalBatchSampler, PackedSequences, token_file  # noqa: E402

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
    p.add_argument("--finetune-steps", type=int, default=120)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--finetune-lr", type=float, default=5e-4)
    p.add_argument("--qat-schemes", default="int4-g256,8da4w-g256")
    p.add_argument("--ptq-schemes", default=",".join(PTQ_DEFAULT))
    p.add_argument("--output", action="store_true", help="also quantize the output head (PTQ and QAT alike)")
    p.add_argument("--embeddings", action="store_true", help="also quantize the token embedding")
    p.add_argument("--eval-sequences", type=int, default=128)
    p.add_argument("--max-bytes", type=int, default=4_000_000)
    p.add_argument("--data", default=None, help="corpus (default: the Python standard library's source)")
    p.add_argument("--cache-dir", default=".cache/fourfold")
    p.add_argument("--device", default="cpu", help="cpu, or cuda for a larger run (training in fp32 there too)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (1 is fastest on a busy machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=f"bench/results/{datetime.date.today()}-cpu-qat")
    p.add_argument("--plot", default="docs/images/quant_ppl_vs_group.png")
    p.add_argument("--from-results", default=None, help="only redo tables, plot and byte counts of this results.json")
    return p.parse_args()


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, data, sampler, steps: int, peak_lr: float, warmup: int, label: str) -> list[float]:
    """`steps` AdamW steps on the sampler's batches; returns the loss of every step."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95))
    model.train()
    losses, t0 = [], time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup)
        rows = torch.stack([data[i] for i in sampler.next_batch()]).to(next(model.parameters()).device)
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % max(1, steps // 10) == 0:
            print(f"  {label} step {step + 1}/{steps}: loss {sum(losses[-20:]) / len(losses[-20:]):.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    model.eval()
    return losses


def model_bytes(model, tmp: Path, meta: dict) -> dict:
    """Bytes of the model's tensors in memory (all, and the block linears' alone) and of its checkpoint on disk."""
    state = model.state_dict()
    memory = sum(t.numel() * t.element_size() for t in state.values())
    linears = sum(t.numel() * t.element_size() for k, t in state.items()
                  if k.startswith("layers.") and "norm" not in k)
    ckpt = save_checkpoint(tmp, 0, model, None, meta, keep=1, writer=True)
    disk = sum(f.stat().st_size for f in ckpt.iterdir())
    return {"memory_bytes": memory, "block_linear_bytes": linears, "disk_bytes": disk}


def all_bytes(cfg, control, converted: dict) -> dict:
    """model_bytes of the control in bf16 and of each converted model (floats in bf16), via temporary checkpoints."""
    with tempfile.TemporaryDirectory() as tmp:
        out = {"bf16": model_bytes(copy.deepcopy(control).to("cpu", torch.bfloat16), Path(tmp) / "bf16",
                                   {"config": cfg.to_dict()})}
        for name, model in converted.items():
            out[name] = model_bytes(copy.deepcopy(model).to("cpu", torch.bfloat16), Path(tmp) / name,
                                    {"config": cfg.to_dict(), "quant": quant_meta(model)})
    return out


def bench_config(a):
    flat = {"model.dim": a.dim, "model.n_layers": a.layers, "model.n_heads": a.heads, "model.n_kv_heads": a.heads // 2,
            "model.ffn_dim": a.ffn, "model.vocab_size": 320, "model.max_seq_len": a.seq, "train.seq_len": a.seq,
            "data.max_bytes": a.max_bytes, "data.cache_dir": a.cache_dir, "compute.device": "cpu"}
    if a.data:
        flat["data.path"] = a.data
    return build_config({}, {k: str(v) for k, v in flat.items()})


def rerender(path: Path, plot_path: str) -> int:
    """Redo the tables, the plot and (from an untrained model of the same shape: sizes depend only on shapes)
    the byte counts of a finished run's results.json, without training again."""
    results = json.loads(path.read_text())
    a = argparse.Namespace(**{"data": None, **results["config"]})
    cfg = bench_config(a)
    fresh = Llama(cfg.model)
    fresh.init_weights(0)
    layers = {"output": getattr(a, "output", False), "embeddings": getattr(a, "embeddings", False)}
    results["bytes"] = all_bytes(cfg, fresh, {n: ptq(copy.deepcopy(fresh), n, **layers) for n in results["qat"]})
    path.write_text(json.dumps(results, indent=1))
    (path.parent / "table.md").write_text(markdown_tables(results))
    print(markdown_tables(results))
    if plot_path:
        plot(results, Path(plot_path))
    return 0


def recovered(ptq_ppl: float, qat_ppl: float, fp_ppl: float) -> float | None:
    gap = ptq_ppl - fp_ppl
    return None if gap <= 0 else (ptq_ppl - qat_ppl) / gap


def main() -> int:
    a = parse_args()
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    layers = {"output": a.output, "embeddings": a.embeddings}
    torch.manual_seed(a.seed)
    start = time.time()
    if a.from_results:
        return rerender(Path(a.from_results), a.plot)
    cfg = bench_config(a)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    path = token_file(cfg.data, tokenizer)
    train_set = PackedSequences(path, a.seq, "train", cfg.data.val_fraction)
    val_set = PackedSequences(path, a.seq, "val", cfg.data.val_fraction)
    print(f"corpus: {len(train_set)} training and {len(val_set)} held-out windows of {a.seq} tokens", flush=True)

    def evaluate(model) -> dict:
        return perplexity(model, val_set, tokenizer, max_sequences=a.eval_sequences, batch=16, device=device)

    base = Llama(cfg.model)
    base.init_weights(a.seed)
    base.to(device)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"model: dim {a.dim}, {a.layers} layers, ffn {a.ffn}: {n_params / 1e6:.2f}M parameters", flush=True)
    pre_losses = train(base, train_set, GlobalBatchSampler(len(train_set), a.batch, a.seed), a.pretrain_steps,
                       a.lr, max(1, a.pretrain_steps // 20), "pretrain")
    results = {"config": vars(a), "params": n_params, "pretrain_final_loss": sum(pre_losses[-50:]) / 50,
               "base": {"fp32": evaluate(base), "ptq": {}}}
    print(f"base: token ppl {results['base']['fp32']['token_ppl']:.4f}", flush=True)
    for name in a.ptq_schemes.split(","):
        results["base"]["ptq"][name] = evaluate(ptq(copy.deepcopy(base), name, **layers))
        print(f"  PTQ {name}: token ppl {results['base']['ptq'][name]['token_ppl']:.4f}", flush=True)

    qat_schemes = [s for s in a.qat_schemes.split(",") if s]
    arms = {}
    for arm in ["control"] + qat_schemes:
        model = copy.deepcopy(base)
        if arm != "control":
            prepare_qat(model, arm, **layers)
        sampler = GlobalBatchSampler(len(train_set), a.batch, a.seed + 1)   # the same batches for every arm
        losses = train(model, train_set, sampler, a.finetune_steps, a.finetune_lr, max(1, a.finetune_steps // 10),
                       f"fine-tune {arm}")
        arms[arm] = model
        results.setdefault("finetune", {})[arm] = {"final_loss": sum(losses[-20:]) / 20}
    control = arms.pop("control")
    results["control"] = {"fp32": evaluate(control), "ptq": {}}
    results["qat"] = {}
    for name, model in arms.items():
        fake = evaluate(model)
        convert(model)
        conv = evaluate(model)
        ptq_ctrl = evaluate(ptq(copy.deepcopy(control), name, **layers))
        results["control"]["ptq"][name] = ptq_ctrl
        fp = results["control"]["fp32"]
        results["qat"][name] = {
            "fake_quant": fake, "converted": conv,
            "recovered_token_ppl": recovered(ptq_ctrl["token_ppl"], conv["token_ppl"], fp["token_ppl"]),
            "recovered_word_ppl": recovered(ptq_ctrl["word_ppl"], conv["word_ppl"], fp["word_ppl"])}
        r = results["qat"][name]
        print(f"QAT {name}: converted token ppl {conv['token_ppl']:.4f} (fake-quant {fake['token_ppl']:.4f}); "
              f"PTQ of control {ptq_ctrl['token_ppl']:.4f}; control {fp['token_ppl']:.4f}; recovered "
              f"{r['recovered_token_ppl']}", flush=True)
    results["bytes"] = all_bytes(cfg, control, arms)
    results["seconds"] = time.time() - start
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print_table(results)
    (out / "table.md").write_text(markdown_tables(results))
    if a.plot:
        plot(results, Path(a.plot))
    print(f"wrote {out / 'results.json'} and {a.plot} in {results['seconds']:.0f}s")
    return 0


def print_table(results: dict) -> None:
    fp = results["control"]["fp32"]
    print(f"\n{'model':<26}{'token ppl':>11}{'word ppl':>11}{'recovered':>11}")
    print(f"{'control (fp32)':<26}{fp['token_ppl']:>11.4f}{fp['word_ppl']:>11.3f}")
    for name, r in results["qat"].items():
        p = results["control"]["ptq"][name]
        rec = r["recovered_token_ppl"]
        print(f"{'PTQ ' + name:<26}{p['token_ppl']:>11.4f}{p['word_ppl']:>11.3f}")
        print(f"{'QAT ' + name + ' (conv.)':<26}{r['converted']['token_ppl']:>11.4f}{r['converted']['word_ppl']:>11.3f}"
              f"{'' if rec is None else f'{100 * rec:>10.0f}%'}")
    for name, b in results["bytes"].items():
        print(f"bytes {name}: {b['disk_bytes']} on disk, {b['memory_bytes']} in memory")


def markdown_tables(results: dict) -> str:
    """The results as the two Markdown tables docs/quantization.md shows (PTQ sweep; QAT vs PTQ vs control)."""
    base, ctrl = results["base"], results["control"]["fp32"]
    lines = ["| scheme (PTQ, round to nearest) | token ppl | word ppl | token ppl vs full precision |",
             "|---|---:|---:|---:|",
             f"| full precision (fp32) | {base['fp32']['token_ppl']:.4f} | {base['fp32']['word_ppl']:.3f} | |"]
    for name, r in base["ptq"].items():
        rel = 100 * (r["token_ppl"] / base["fp32"]["token_ppl"] - 1)
        lines.append(f"| {name} | {r['token_ppl']:.4f} | {r['word_ppl']:.3f} | {rel:+.2f}% |")
    lines += ["", "| scheme | control (fp32 fine-tune) | PTQ of control | QAT, converted | QAT, fake-quant "
              "| recovered (token ppl) | recovered (word ppl) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in results["qat"].items():
        p = results["control"]["ptq"][name]
        rec = [("n/a" if v is None else f"{100 * v:.0f}%") for v in (r["recovered_token_ppl"], r["recovered_word_ppl"])]
        lines.append(f"| {name} | {ctrl['token_ppl']:.4f} | {p['token_ppl']:.4f} | {r['converted']['token_ppl']:.4f} "
                     f"| {r['fake_quant']['token_ppl']:.4f} | {rec[0]} | {rec[1]} |")
    lines += ["", "| model | bytes on disk (checkpoint) | bytes in memory (all tensors) | vs bf16 "
              "| block linears (weights + scales + zero points) | vs bf16 |", "|---|---:|---:|---:|---:|---:|"]
    bf16 = results["bytes"]["bf16"]
    for name, b in results["bytes"].items():
        lin = b.get("block_linear_bytes")
        lin_text = "" if lin is None else f"{lin:,} | {lin / bf16['block_linear_bytes']:.3f}"
        lines.append(f"| {name} | {b['disk_bytes']:,} | {b['memory_bytes']:,} | "
                     f"{b['memory_bytes'] / bf16['memory_bytes']:.3f} | {lin_text} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [32, 64, 128, 256]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    base = results["base"]
    for kind, style in (("int4-g{}", "o-"), ("int4-g{}-asym", "s--"), ("8da4w-g{}", "^-")):
        names = [kind.format(g) for g in groups]
        if all(n in base["ptq"] for n in names):
            ax.plot(groups, [base["ptq"][n]["token_ppl"] for n in names], style, label="PTQ " + kind.format("G"))
    if "int8" in base["ptq"]:
        ax.axhline(base["ptq"]["int8"]["token_ppl"], color="gray", ls=":", label="PTQ int8 (per channel)")
    ax.axhline(base["fp32"]["token_ppl"], color="black", label="full precision (pretrained)")
    ax.axhline(results["control"]["fp32"]["token_ppl"], color="black", ls="--", label="full precision, fine-tuned")
    for name, r in results["qat"].items():
        g = int(name.split("-g")[1].split("-")[0])
        ax.plot([g], [r["converted"]["token_ppl"]], "*", ms=12, label=f"QAT {name} (converted)")
        ax.plot([g], [results["control"]["ptq"][name]["token_ppl"]], "x", ms=9,
                label=f"PTQ {name} of the fine-tuned control")
    ax.set_xscale("log", base=2)
    ax.set_xticks(groups, [str(g) for g in groups])
    ax.set_xlabel("group size (input features per scale)")
    ax.set_ylabel("held-out token perplexity")
    head = ", head quantized too" if results["config"].get("output") else ""
    ax.set_title(f"4-bit weights: PTQ vs QAT (CPU, stdlib corpus{head})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
