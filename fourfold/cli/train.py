"""`fourfold train`: train with a config and dotted overrides, in this process or relaunched under torchrun.

    fourfold train --config configs/tiny.toml --out runs/tiny [--resume [PATH]] [--nproc N] [--section.key value ...]
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

from fourfold.cli.common import ArgumentParser
from fourfold.errors import ConfigError


def _train_parser() -> ArgumentParser:
    p = ArgumentParser(prog="fourfold train", description="Train a Llama-family model.",
                       epilog="Any config key can be overridden: --train.steps 100 --parallel.fsdp 2 "
                              "(see `fourfold config`).")
    p.add_argument("--config", help="TOML config file (configs/tiny.toml, ...); defaults are the tiny CPU run")
    p.add_argument("--out", help="run directory (default runs/<timestamp>)")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="resume from the latest checkpoint in --out, or from the given checkpoint directory")
    p.add_argument("--nproc", type=int, default=None, help="start N local processes with torchrun (gloo or NCCL)")
    p.add_argument("--sample", default="def ",
                   help="prompt for the sample printed after training (single process); '' to skip")
    return p


def _launch_torchrun(nproc: int, argv: list[str]) -> int:
    """Re-run this command under torchrun (in this process, as `torchrun` itself does) with `nproc` workers.

    A worker that stops on a user error prints its one paragraph and exits with 2; this returns 2 then
    instead of letting torchrun print its own traceback.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    try:
        run(parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "fourfold", "train", *rest]))
    except ChildFailedError as e:
        if any(f.exitcode == 2 for f in e.failures.values()):
            return 2  # the worker has said what to change
        print(e.format_msg(), file=sys.stderr)
        return 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


def _check_train_inputs(cfg, args, world: int, out: str) -> None:
    """Everything about a training run that can be checked before any work: layout, device, folders, data."""
    from fourfold.distributed import check_device
    from fourfold.layout import validate_layout
    from fourfold.preflight import check_output_dir
    from fourfold.train.dataset import check_data_source

    validate_layout(cfg, world)
    check_device(cfg.compute.device, "--compute.device", args.nproc or 1)
    check_output_dir(out, "--out")
    check_output_dir(cfg.data.cache_dir, "--data.cache_dir")
    check_data_source(cfg)
    if cfg.quant.qat is not None:   # groups must divide every quantized layer (and its tensor-parallel shard)
        from fourfold.quant.qat import check_config_fits

        check_config_fits(cfg.model, cfg.quant, cfg.parallel.tp)


def main(argv: list[str], console: Console) -> int:
    """`fourfold train`: train with the config and overrides in `argv`; return the exit code.

    With --nproc N > 1 outside torchrun it checks the run against N processes, then relaunches itself under
    torchrun; a single process prints a summary and a sample from the final checkpoint.
    """
    from fourfold.config import load_config
    from fourfold.train.trainer import default_run_dir, quiet_nonzero_ranks, train

    args, overrides = _train_parser().parse_known_args(argv)
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: the number of processes must be at least 1; pass --nproc N with "
                          "N >= 1 (1 runs in this process), or leave it out.")
    cfg = load_config(args.config, overrides)
    under_torchrun = "RANK" in os.environ
    launch = bool(args.nproc and args.nproc > 1 and not under_torchrun)
    world = args.nproc if launch else int(os.environ.get("WORLD_SIZE", "1"))
    if under_torchrun and world > 1 and not args.out:
        raise ConfigError("Under torchrun pass --out DIR so every rank writes to the same run directory.")
    out = args.out or str(default_run_dir())
    _check_train_inputs(cfg, args, world, out)
    if launch:
        return _launch_torchrun(args.nproc, argv if args.out else [*argv, "--out", out])
    with quiet_nonzero_ranks():
        summary = train(cfg, out, resume=args.resume or False, console=console)
    single = int(os.environ.get("WORLD_SIZE", "1")) == 1
    if single and summary.first_loss is not None:
        console.print(f"[bold green]done[/]: loss {summary.first_loss:.3f} -> {summary.last_loss:.3f}"
                      + (f", validation {summary.val_loss:.3f}" if summary.val_loss is not None else "")
                      + f", {summary.tokens_per_s:,.0f} tokens/s; run dir {summary.run_dir}")
        if args.sample and cfg.checkpoint.save_final:
            _print_sample(summary.run_dir, args.sample, console)
    return 0


def _print_sample(run_dir, prompt: str, console: Console) -> None:
    import torch

    from fourfold.infer.generate import SamplingOptions, generate_text

    text = generate_text(run_dir, prompt, SamplingOptions(max_new_tokens=200), torch.device("cpu"))
    console.rule("sample")
    console.print(prompt + text, markup=False, highlight=False)
    console.rule()
