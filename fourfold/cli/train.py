"""`fourfold train`: train with a config and dotted overrides, in this process or relaunched under torchrun.

    fourfold train --config configs/tiny.toml --out runs/tiny [--resume [PATH]] [--nproc N [--max-restarts K]]
                   [--section.key value ...]

With --max-restarts K (torchrun's own option, also usable as `torchrun --max-restarts K -m fourfold train`),
a job whose rank dies is restarted up to K times and each restart resumes from the newest complete
checkpoint of --out (fourfold/train/restart.py). SIGTERM saves a checkpoint and exits with 143.
"""

from __future__ import annotations

import os

from rich.console import Console

from fourfold.cli.common import ArgumentParser, launch_torchrun, without
from fourfold.errors import ConfigError


def _train_parser() -> ArgumentParser:
    p = ArgumentParser(prog="fourfold train", description="Train a Llama-family model.",
                       epilog="Any config key can be overridden: --train.steps 100 --parallel.fsdp 2 "
                              "(see `fourfold config`).")
    p.add_argument("--config", help="TOML config file (configs/tiny.toml, ...); defaults are the tiny CPU run")
    p.add_argument("--out", help="run directory (default runs/<timestamp>)")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="resume from the latest checkpoint in --out, or from the given checkpoint directory")
    p.add_argument("--nproc", type=int, default=None, metavar="N", help="start N local processes with torchrun (gloo or NCCL)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="with --nproc: restart the job up to K times when a rank dies, resuming from the newest "
                        "checkpoint in --out")
    p.add_argument("--sample", default="def ",
                   help="prompt for the sample printed after training (single process); '' to skip")
    return p


def _launch_torchrun(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Re-run `fourfold train` under torchrun with `nproc` workers (fourfold.cli.common.launch_torchrun)."""
    return launch_torchrun("train", nproc, without(argv, ("--nproc", "--max-restarts")), max_restarts)


def _check_train_inputs(cfg, args, world: int, out: str) -> None:
    """Everything about a training run that can be checked before any work: layout, device, folders, data."""
    from fourfold.checkpoint.init_from import config_with_init_model
    from fourfold.distributed import check_device
    from fourfold.layout import validate_layout
    from fourfold.preflight import check_output_dir
    from fourfold.train.dataset import check_data_source

    cfg = config_with_init_model(cfg)  # checkpoint.init_from: the layout and data checks see its model shape
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
    from fourfold.distributed import shutdown
    from fourfold.train.trainer import default_run_dir, quiet_nonzero_ranks, train

    args, overrides = _train_parser().parse_known_args(argv)
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: the number of processes must be at least 1; pass --nproc N with "
                          "N >= 1 (1 runs in this process), or leave it out.")
    if args.max_restarts < 0 or (args.max_restarts and not (args.nproc and args.nproc > 1)):
        raise ConfigError(f"--max-restarts {args.max_restarts}: pass a number K >= 0 together with --nproc N "
                          "(N >= 2), which launches torchrun; for other launches give torchrun its own "
                          "`--max-restarts K` (`torchrun --max-restarts K ... -m fourfold train ...`).")
    cfg = load_config(args.config, overrides)
    under_torchrun = "RANK" in os.environ
    launch = bool(args.nproc and args.nproc > 1 and not under_torchrun)
    world = args.nproc if launch else int(os.environ.get("WORLD_SIZE", "1"))
    if under_torchrun and world > 1 and not args.out:
        raise ConfigError("Under torchrun pass --out DIR so every rank writes to the same run directory.")
    out = args.out or str(default_run_dir())
    _check_train_inputs(cfg, args, world, out)
    if launch:
        return _launch_torchrun(args.nproc, argv if args.out else [*argv, "--out", out], args.max_restarts)
    with quiet_nonzero_ranks():
        summary = train(cfg, out, resume=args.resume or False, console=console)
    shutdown()
    if summary.stopped_by is not None:
        return 128 + summary.stopped_by
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
