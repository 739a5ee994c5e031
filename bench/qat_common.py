"""Shared pieces of the QAT-vs-PTQ benchmarks: the training loop, the fine-tune arms, tables and the plot.

bench/qat_vs_ptq.py (a Llama pretrained here) and bench/qat_smollm2.py (an imported SmolLM2) both call
`run_experiment` (PTQ of the base, then `compare_arms`, then bytes). `compare_arms`: from one base model, N fine-tune steps on the same batches in full precision (the control)
and with QAT per scheme, then held-out perplexity of the control, of the control's PTQ (fake-quant and
converted) and of each QAT model (fake-quant and converted), and the recovered fraction
(ppl(PTQ of control) - ppl(QAT)) / (ppl(PTQ of control) - ppl(control)).
"""

from __future__ import annotations

import copy
import contextlib
import json
import math
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fourfold.checkpoint.store import save_checkpoint
from fourfold.cli.eval import perplexity
from fourfold.quant.qat import convert, prepare_qat, ptq, quant_meta
from fourfold.train.dataset import GlobalBatchSampler
from qat_report import markdown_tables, plot   # bench/ (the script's directory) is on sys.path


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def autocast(device: torch.device, bf16: bool):
    """bf16 autocast on `device` when asked (weights and optimizer stay fp32), else nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def train(model, data, sampler, steps: int, peak_lr: float, warmup: int, label: str, *, bf16: bool = False,
          weight_decay: float = 0.1) -> list[float]:
    """`steps` AdamW steps (cosine to 10%, clip 1.0) on the sampler's batches; returns every step's loss.
    Parameters with requires_grad False (a frozen embedding) are left out."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if p.dim() >= 2]
    rest = [p for n, p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95))
    device = next(model.parameters()).device
    model.train()
    losses, t0 = [], time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, warmup)
        rows = torch.stack([data[i] for i in sampler.next_batch()]).to(device)
        with autocast(device, bf16):
            logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % max(1, steps // 10) == 0:
            print(f"  {label} step {step + 1}/{steps}: loss {sum(losses[-20:]) / len(losses[-20:]):.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    model.eval()
    return losses


def evaluator(val_set, tokenizer, *, sequences: int, batch: int, device: torch.device, bf16: bool = False):
    """evaluate(model) -> fourfold eval's perplexity dict on the first `sequences` held-out windows."""
    def evaluate(model) -> dict:
        with autocast(device, bf16):
            return perplexity(model, val_set, tokenizer, max_sequences=sequences, batch=batch, device=device)
    return evaluate


def recovered(ptq_ppl: float, qat_ppl: float, fp_ppl: float) -> float | None:
    gap = ptq_ppl - fp_ppl
    return None if gap <= 0 else (ptq_ppl - qat_ppl) / gap


def calibration_batches(train_set, sequences: int, seed: int, batch: int = 8) -> list[torch.Tensor]:
    """GPTQ's calibration data: `sequences` training windows (a seeded random choice) in batches of `batch`."""
    if sequences <= 0:
        return []
    picks = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(seed + 7))[:sequences].tolist()
    rows = torch.stack([train_set[i] for i in picks])[:, :-1]   # a window is inputs + the last target
    return list(rows.split(batch))


def ptq_sweep(model, schemes: list[str], evaluate, layers: dict, label: str, method: str = "rtn",
              calibration: list | None = None) -> dict:
    """{scheme: perplexity of PTQ of `model`} by `method` (round to nearest, or GPTQ on `calibration`), converted
    models (packed int4/int8)."""
    out = {}
    for name in schemes:
        out[name] = evaluate(ptq(copy.deepcopy(model), name, method=method, calibration=calibration, **layers))
        print(f"  PTQ ({method}) {name} of the {label}: token ppl {out[name]['token_ppl']:.4f}", flush=True)
    return out


def compare_arms(base, train_set, evaluate, *, schemes: list[str], steps: int, lr: float, batch: int, seed: int,
                 layers: dict, bf16: bool, weight_decay: float = 0.1,
                 calibration: list | None = None) -> tuple[dict, object, dict]:
    """Fine-tune copies of `base` N steps on the same batches: the control (full precision) and QAT per scheme.

    Returns (results with "finetune", "control", "qat" entries, the control model, {scheme: converted QAT
    model}). "recovered_*" uses the converted models on both sides (PTQ of the control, QAT converted);
    "recovered_fake_*" the fake-quant ones (the same integers, evaluated in the model's float dtype).
    With `calibration` batches, GPTQ of the control is one more PTQ arm: "control"/"ptq_gptq", the share of
    round-to-nearest's loss that GPTQ wins back without training ("gptq_recovered_*") and the share of GPTQ's own
    loss that QAT wins back ("recovered_vs_gptq_*").
    """
    results = {"finetune": {}, "control": {"ptq": {}, "ptq_fake": {}}, "qat": {}}
    arms = {}
    for arm in ["control"] + schemes:
        model = copy.deepcopy(base)
        if arm != "control":
            prepare_qat(model, arm, **layers)
        sampler = GlobalBatchSampler(len(train_set), batch, seed + 1)   # the same batches for every arm
        t0 = time.time()
        losses = train(model, train_set, sampler, steps, lr, max(1, steps // 10), f"fine-tune {arm}", bf16=bf16,
                       weight_decay=weight_decay)
        arms[arm] = model
        results["finetune"][arm] = {"final_loss": sum(losses[-20:]) / len(losses[-20:]), "seconds": time.time() - t0}
    control = arms.pop("control")
    fp = results["control"]["fp32"] = evaluate(control)
    print(f"control: token ppl {fp['token_ppl']:.4f}", flush=True)
    for name, model in arms.items():
        fake = evaluate(model)
        convert(model)
        conv = evaluate(model)
        ptq_fake = evaluate(prepare_qat(copy.deepcopy(control), name, **layers))
        ptq_conv = evaluate(ptq(copy.deepcopy(control), name, **layers))
        results["control"]["ptq"][name], results["control"]["ptq_fake"][name] = ptq_conv, ptq_fake
        r = results["qat"][name] = {"fake_quant": fake, "converted": conv}
        for unit in ("token_ppl", "word_ppl"):
            r[f"recovered_{unit}"] = recovered(ptq_conv[unit], conv[unit], fp[unit])
            r[f"recovered_fake_{unit}"] = recovered(ptq_fake[unit], fake[unit], fp[unit])
        if calibration:
            gptq = results["control"].setdefault("ptq_gptq", {})[name] = evaluate(
                ptq(copy.deepcopy(control), name, method="gptq", calibration=calibration, **layers))
            for unit in ("token_ppl", "word_ppl"):
                r[f"gptq_recovered_{unit}"] = recovered(ptq_conv[unit], gptq[unit], fp[unit])
                r[f"recovered_vs_gptq_{unit}"] = recovered(gptq[unit], conv[unit], fp[unit])
            print(f"  PTQ (gptq) {name} of the control: token ppl {gptq['token_ppl']:.4f}", flush=True)
        print(f"QAT {name}: converted token ppl {conv['token_ppl']:.4f} (fake-quant {fake['token_ppl']:.4f}); "
              f"PTQ of control {ptq_conv['token_ppl']:.4f} (fake-quant {ptq_fake['token_ppl']:.4f}); control "
              f"{fp['token_ppl']:.4f}; recovered {r['recovered_token_ppl']} (fake-quant "
              f"{r['recovered_fake_token_ppl']})", flush=True)
    return results, control, arms


def schemes_of(csv: str) -> list[str]:
    """The scheme names of a comma-separated option, empty entries left out."""
    return [s for s in csv.split(",") if s]


def run_experiment(base, train_set, evaluate, cfg, results: dict, a, *, layers: dict, bf16: bool,
                   weight_decay: float = 0.1) -> None:
    """Everything after the base's own perplexity, into `results`: PTQ of the base per --ptq-schemes (round to
    nearest; GPTQ of each --qat-schemes too when --gptq-calibration gives windows), compare_arms over --qat-schemes,
    and the bytes of the control and of each converted model."""
    results["base"]["ptq"] = ptq_sweep(base, schemes_of(a.ptq_schemes), evaluate, layers, "base")
    calibration = calibration_batches(train_set, a.gptq_calibration, a.seed)
    if calibration:
        results["base"]["ptq_gptq"] = ptq_sweep(base, schemes_of(a.qat_schemes), evaluate, layers, "base",
                                                method="gptq", calibration=calibration)
    arms, control, converted = compare_arms(
        base, train_set, evaluate, schemes=schemes_of(a.qat_schemes), steps=a.finetune_steps, lr=a.finetune_lr,
        batch=a.batch, seed=a.seed, layers=layers, bf16=bf16, calibration=calibration, weight_decay=weight_decay)
    results.update(arms)
    results["bytes"] = all_bytes(cfg, control, converted)


def model_bytes(model, tmp: Path, meta: dict) -> dict:
    """Bytes of the model's tensors in memory (all, tied ones once; and the block linears' alone) and of its checkpoint
    on disk."""
    state = model.state_dict()
    unique = {t.data_ptr(): t for t in state.values()}   # a tied head and embedding are one tensor in memory
    memory = sum(t.numel() * t.element_size() for t in unique.values())
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


def write_outputs(results: dict, out: Path, plot_path: str, title: str) -> None:
    """results.json and table.md into `out`, the plot to `plot_path` (when given); prints the tables."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(markdown_tables(results))
    print(markdown_tables(results))
    if plot_path:
        plot(results, Path(plot_path), title)
        if Path(plot_path).resolve().parent != out.resolve():
            plot(results, out / Path(plot_path).name, title)
