"""`fourfold quantize`: convert a checkpoint into a low-bit one (packed int4 / int8 weights + scales) by PTQ or from QAT.

    fourfold quantize --checkpoint runs/tiny --scheme int4-g128 --out runs/tiny-int4 [--method rtn]
    fourfold quantize --checkpoint runs/tiny --scheme int4-g128 --out runs/tiny-gptq --method gptq \
        [--calibration-sequences 32] [--data PATH]
    fourfold quantize --checkpoint runs/tiny-qat --out runs/tiny-qat-int4      # a QAT run: its own scheme

A full-precision checkpoint is quantized post-training: round to nearest, or GPTQ calibrated on the first
--calibration-sequences windows of the training split of the checkpoint's corpus or of --data (never the
held-out split that `fourfold eval` scores); a QAT checkpoint (trained with
--quant.qat SCHEME) is converted with the scheme it trained with, reproducing its fake-quant forward. The
result is a fourfold checkpoint in OUT/checkpoints/step_N/: safetensors holding the packed weights, scales
and zero points (no pickle) and meta.json with "quant": {"scheme", "embeddings", "output", "method"};
`fourfold generate`, `fourfold eval` and the engine load it. Every input is checked before any weight is read.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from fourfold.cli.common import ArgumentParser
from fourfold.errors import CheckpointError, ConfigError


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="fourfold quantize", description="Quantize a checkpoint (PTQ, or conversion of QAT).")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory or run directory (newest checkpoint)")
    p.add_argument("--scheme", default=None, help="int8, int4-g32..256[-asym], 8da4w-g32..256 (each also -fp32); "
                                                   "default for a QAT checkpoint: the scheme it trained with")
    p.add_argument("--out", required=True, help="run directory to write the converted checkpoint into")
    p.add_argument("--method", default="rtn", help="post-training method: rtn (round to nearest) or gptq")
    p.add_argument("--calibration-sequences", type=int, default=32,
                   help="gptq: training-split windows (train.seq_len tokens) whose inputs calibrate each layer")
    p.add_argument("--data", default=None, help="gptq: text file, directory or glob (default: the checkpoint's corpus)")
    p.add_argument("--embeddings", action="store_true", help="also quantize the token embedding")
    p.add_argument("--output", action="store_true", help="also quantize the output head")
    p.add_argument("--device", default="cpu", help="where the converted model will run (checked): cpu or cuda")
    return p


def _pick_scheme(requested: str | None, trained: str | None) -> str:
    if trained and requested and requested != trained:
        raise ConfigError(f"This checkpoint was trained with --quant.qat {trained}; converting it with {requested} "
                          f"would discard what QAT learned. Omit --scheme (or pass {trained}), or quantize a "
                          "full-precision checkpoint instead.")
    scheme = requested or trained
    if scheme is None:
        raise ConfigError("fourfold quantize needs --scheme for a full-precision checkpoint, e.g. --scheme int4-g128.")
    return scheme


def calibration_batches(cfg, data_path: str | None, sequences: int, batch: int = 8) -> list:
    """Token batches [batch, seq_len] of the first `sequences` windows of the corpus's training split (for GPTQ)."""
    import torch

    from fourfold.cli.eval import corpus_windows

    _, windows = corpus_windows(cfg, data_path, "train")
    rows = [windows[i][:-1] for i in range(min(sequences, len(windows)))]
    return [torch.stack(rows[i:i + batch]) for i in range(0, len(rows), batch)]


def main(argv: list[str], console: Console) -> int:
    """`fourfold quantize`: write the converted checkpoint and print its size; return 0."""
    import torch

    from fourfold.checkpoint.listing import find_checkpoint
    from fourfold.checkpoint.store import load_checkpoint, read_meta, save_checkpoint
    from fourfold.config import build_config
    from fourfold.models.llama import Llama
    from fourfold.preflight import check_output_dir
    from fourfold.checkpoint.consolidated import extra_files_of
    from fourfold.quant.qat import (PTQ_METHODS, apply_checkpoint_quant, check_device_runs, check_scheme_fits, convert,
                                    ptq, quant_meta)
    from fourfold.quant.schemes import scheme_by_name
    from fourfold.units import format_bytes

    a = _parser().parse_args(argv)
    if a.method not in PTQ_METHODS:
        raise ConfigError(f"--method {a.method!r} is not one of {', '.join(PTQ_METHODS)}.")
    if a.calibration_sequences < 1:
        raise ConfigError("--calibration-sequences must be at least 1.")
    if a.device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {a.device!r} is not cpu or cuda.")
    ckpt = find_checkpoint(a.checkpoint)
    meta = read_meta(ckpt)
    if meta.get("quant"):
        raise ConfigError(f"{ckpt} is already quantized ({meta['quant'].get('scheme')}); quantize the "
                          "full-precision or QAT checkpoint it came from.")
    if "config" not in meta:
        raise CheckpointError(f"{ckpt / 'meta.json'} has no \"config\"; it is not a fourfold training checkpoint.")
    saved = {k: v for k, v in meta["config"].items() if k != "parallel"}
    cfg = build_config(saved)
    qat = cfg.quant.qat
    scheme = scheme_by_name(_pick_scheme(a.scheme, qat))
    if qat and a.method != "rtn":
        raise ConfigError(f"--method {a.method} is for full-precision checkpoints; a QAT checkpoint converts with the "
                          "scheme it trained with. Omit --method.")
    embeddings, output = (cfg.quant.embeddings, cfg.quant.output) if qat else (a.embeddings, a.output)
    if a.device == "cuda" and torch.cuda.is_available():
        check_device_runs(scheme, torch.device("cuda"))
    elif a.device == "cuda":
        raise ConfigError("--device cuda: no CUDA device is visible here; convert with --device cpu (the file "
                          "is the same) and run it where the GPU is.")
    with torch.device("meta"):
        check_scheme_fits(Llama(cfg.model), scheme, embeddings=embeddings, output=output, for_kernels=True)
    check_output_dir(a.out, "--out")
    gptq = a.method == "gptq" and not qat
    calibration = calibration_batches(cfg, a.data, a.calibration_sequences) if gptq else None

    model = apply_checkpoint_quant(Llama(cfg.model), meta)
    load_checkpoint(ckpt, model, None)
    before = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if qat:
        convert(model)
    else:
        ptq(model, scheme, method=a.method, embeddings=embeddings, output=output, calibration=calibration)
    after = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    extra = extra_files_of(Path(ckpt))  # tokenizer and chat-template files, not the checkpoint's bookkeeping
    out_meta = {"config": meta["config"], "quant": quant_meta(model), "tokenizer": meta.get("tokenizer"),
                "quantized_from": str(ckpt)}
    path = save_checkpoint(Path(a.out), int(meta.get("step", 0)), model, None, out_meta, keep=0, writer=True,
                           extra_files=extra)
    how = "converted from QAT" if qat else f"post-training ({a.method})"
    console.print(f"{scheme.name} {how}: {format_bytes(before)} -> {format_bytes(after)} of tensors; wrote {path}")
    return 0
