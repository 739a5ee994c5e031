"""`fourfold convert`: import Hugging Face / GGUF models, export to Hugging Face, consolidate checkpoints.

    fourfold convert SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2        # GGUF -> fourfold
    fourfold convert path/to/hf-llama models/llama                          # Hugging Face directory -> fourfold
    fourfold convert runs/tiny hf/tiny --to hf [--dtype bf16]               # fourfold -> Hugging Face
    fourfold convert runs/big/checkpoints/step_100 models/big               # sharded checkpoint -> one file

SRC is a .gguf file, a Hugging Face directory (config.json + safetensors) or a fourfold checkpoint or run
directory; DST is a new or empty directory (--force replaces a non-empty one). --to picks the output
format: fourfold (the default) or hf. A fourfold checkpoint written here is what `fourfold generate
--checkpoint DST` loads; it carries the source's tokenizer and chat template.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rich.console import Console

from fourfold.cli.common import ArgumentParser
from fourfold.errors import ConfigError

FORMATS = ("fourfold", "hf")
DTYPES = ("fp32", "bf16", "fp16")


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="fourfold convert", description="Convert models between fourfold, Hugging Face and GGUF.")
    p.add_argument("src", help="a .gguf file, a Hugging Face directory, or a fourfold checkpoint/run directory")
    p.add_argument("dst", help="output directory (new or empty, or --force)")
    p.add_argument("--to", choices=FORMATS, default="fourfold", help="output format (default: fourfold)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="cast the weights (default: keep; GGUF: fp32)")
    p.add_argument("--force", action="store_true", help="replace DST if it is not empty")
    return p


def source_kind(src: Path) -> str:
    """'gguf', 'hf' or 'fourfold' for an existing source path; ConfigError naming what was expected otherwise."""
    from fourfold.checkpoint.hf_import import is_hf_dir
    from fourfold.checkpoint.store import checkpoint_at

    if not src.exists():
        raise ConfigError(f"fourfold convert: the source '{src}' does not exist; pass a .gguf file, a Hugging Face "
                          "model directory or a fourfold checkpoint/run directory.")
    if src.is_file():
        with open(src, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        raise ConfigError(f"fourfold convert: '{src}' is a file but not a GGUF model (it does not start with 'GGUF'); "
                          "the only single-file source is a .gguf file.")
    if is_hf_dir(src):
        return "hf"
    if checkpoint_at(src) is not None:
        return "fourfold"
    raise ConfigError(f"fourfold convert: '{src}' is neither a Hugging Face model directory (config.json) nor a "
                      "fourfold checkpoint or run directory (meta.json, or checkpoints/step_N inside).")


def prepare_destination(src: Path, dst: Path, force: bool) -> None:
    """Refuse a destination that is a file, holds the source or is not empty (unless --force, which empties it)."""
    if dst.exists() and not dst.is_dir():
        raise ConfigError(f"fourfold convert: the destination '{dst}' is a file; pass a directory path.")
    s, d = src.resolve(), dst.resolve()
    if d == s or d in s.parents or s in d.parents:
        raise ConfigError(f"fourfold convert: the destination '{dst}' overlaps the source '{src}'; write elsewhere.")
    if dst.is_dir() and any(dst.iterdir()):
        if not force:
            raise ConfigError(f"fourfold convert: the destination '{dst}' is not empty; choose a new directory or "
                              "pass --force to replace its contents.")
        shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)


def convert(src: Path, dst: Path, to: str, dtype: str | None, force: bool = False) -> tuple[str, Path]:
    """Run the conversion; (source kind, output directory)."""
    kind = source_kind(src)
    if kind in ("hf", "gguf") and to == "hf":
        raise ConfigError(f"fourfold convert: '{src}' is a {'Hugging Face directory' if kind == 'hf' else 'GGUF file'}; "
                          "--to hf exports fourfold checkpoints. Import it first (--to fourfold), or pass a fourfold "
                          "checkpoint.")
    prepare_destination(src, dst, force)
    if kind == "gguf":
        from fourfold.checkpoint.gguf_import import import_gguf

        return kind, import_gguf(src, dst, dtype)
    if kind == "hf":
        from fourfold.checkpoint.hf_import import import_hf

        return kind, import_hf(src, dst, dtype)
    if to == "hf":
        from fourfold.checkpoint.hf_export import export_hf

        return kind, export_hf(src, dst, dtype)
    if dtype is not None:
        raise ConfigError("fourfold convert: --dtype applies to imports and --to hf exports; consolidating a fourfold "
                          "checkpoint keeps its dtype.")
    from fourfold.checkpoint.consolidated import consolidate

    return kind, consolidate(src, dst)


def main(argv: list[str], console: Console) -> int:
    """`fourfold convert SRC DST [--to fourfold|hf] [--dtype ...] [--force]`; return 0."""
    args = _parser().parse_args(argv)
    kind, out = convert(Path(args.src), Path(args.dst), args.to, args.dtype, args.force)
    names = {"gguf": "GGUF file", "hf": "Hugging Face directory", "fourfold": "fourfold checkpoint"}
    what = "Hugging Face directory" if args.to == "hf" else "fourfold checkpoint"
    console.print(f"Converted the {names[kind]} {args.src} into the {what} {out}.", highlight=False, soft_wrap=True)
    if args.to == "fourfold":
        console.print(f"Try it: fourfold generate --checkpoint {out} --prompt 'Hello'", highlight=False, soft_wrap=True)
    return 0
