"""The `fourfold` command line: train, generate, and the config reference.

    fourfold train --config configs/tiny.toml --out runs/tiny [--resume [PATH]] [--nproc N] [--section.key value ...]
    torchrun --standalone --nproc-per-node 4 -m fourfold train --config configs/tiny.toml --parallel.fsdp 4
    fourfold generate --checkpoint runs/tiny --prompt "def "
    fourfold config            # every config key with its default and meaning

User mistakes (a missing file, an unknown key, an impossible layout, a corrupt checkpoint) end with a
one-paragraph message saying what to change and exit code 2, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from rich.console import Console

from fourfold.errors import FourfoldError


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fourfold train", description="Train a Llama-family model.",
                                epilog="Any config key can be overridden: --train.steps 100 --parallel.fsdp 2 "
                                       "(see `fourfold config`).")
    p.add_argument("--config", help="TOML config file (configs/tiny.toml, ...); defaults are the tiny CPU run")
    p.add_argument("--out", help="run directory (default runs/<timestamp>)")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="resume from the latest checkpoint in --out, or from the given checkpoint directory")
    p.add_argument("--nproc", type=int, default=0, help="start N local processes with torchrun (gloo or NCCL)")
    p.add_argument("--sample", default="def ",
                   help="prompt for the sample printed after training (single process); '' to skip")
    return p


def _launch_torchrun(nproc: int, argv: list[str]) -> int:
    """Re-run this command under torchrun with `nproc` local processes."""
    rest, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "fourfold", "train", *rest]
    return subprocess.call(cmd)


def cmd_train(argv: list[str], console: Console) -> int:
    """`fourfold train`: train with the config and overrides in `argv`; return the exit code.

    With --nproc N > 1 outside torchrun it relaunches itself under torchrun; a single process then prints a
    summary and a sample from the final checkpoint.
    """
    from fourfold.config import load_config
    from fourfold.train.trainer import default_run_dir, quiet_nonzero_ranks, train

    args, overrides = _train_parser().parse_known_args(argv)
    cfg = load_config(args.config, overrides)
    if args.nproc and args.nproc > 1 and "RANK" not in os.environ:
        if not args.out:
            argv = [*argv, "--out", str(default_run_dir())]
        return _launch_torchrun(args.nproc, argv)
    if not args.out and "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from fourfold.errors import ConfigError

        raise ConfigError("Under torchrun pass --out DIR so every rank writes to the same run directory.")
    with quiet_nonzero_ranks():
        summary = train(cfg, args.out, resume=args.resume or False, console=console)
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


def cmd_generate(argv: list[str], console: Console) -> int:
    """`fourfold generate`: print the prompt and a sampled continuation from a checkpoint; return 0."""
    import torch

    from fourfold.distributed import pick_device
    from fourfold.infer.generate import SamplingOptions, generate_text

    p = argparse.ArgumentParser(prog="fourfold generate", description="Sample a continuation from a checkpoint.")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory or run directory (newest checkpoint)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    p.add_argument("--top-k", type=int, default=50, help="0 disables")
    p.add_argument("--top-p", type=float, default=0.95, help="1.0 disables")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    opts = SamplingOptions(a.max_new_tokens, a.temperature, a.top_k, a.top_p, a.seed)
    torch.manual_seed(a.seed)
    text = generate_text(a.checkpoint, a.prompt, opts, pick_device(a.device))
    print(a.prompt + text)
    return 0


def cmd_config(argv: list[str], console: Console) -> int:
    """`fourfold config`: print the config reference; return 0."""
    from fourfold.config import describe

    print(describe())
    return 0


COMMANDS = {"train": cmd_train, "generate": cmd_generate, "config": cmd_config}


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand named in `argv`; return the exit code (2 for user errors, 130 on Ctrl-C)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    console = Console()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            from fourfold.errors import closest

            console.print(f"[red]Unknown command '{argv[0]}'.{closest(argv[0], COMMANDS)}[/]")
        console.print(__doc__)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:], console)
    except FourfoldError as e:
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
        from rich.markup import escape

        Console(stderr=True, soft_wrap=True).print(f"[bold red]error[/]: {escape(prefix + str(e))}", highlight=False)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
