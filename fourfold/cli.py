"""The `fourfold` command line: train, generate, and the config reference.

    fourfold train --config configs/tiny.toml --out runs/tiny [--resume [PATH]] [--nproc N] [--section.key value ...]
    torchrun --standalone --nproc-per-node 4 -m fourfold train --config configs/tiny.toml --parallel.fsdp 4
    fourfold generate --checkpoint runs/tiny --prompt "def "
    fourfold config            # every config key with its default, valid values and meaning

User mistakes (a missing file, an unknown key, a value out of range, an impossible layout, an unwritable
run directory, a corrupt checkpoint) end with a one-paragraph message saying what to change and exit
code 2, without a traceback, before any work starts: `train --nproc N` checks the layout against N
before it launches torchrun.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from rich.console import Console

from fourfold.errors import ConfigError, FourfoldError


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are ConfigErrors: one paragraph and exit code 2, like every user mistake."""

    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message}. See `{self.prog} --help`.")


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


def cmd_train(argv: list[str], console: Console) -> int:
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


def _generate_parser() -> ArgumentParser:
    p = ArgumentParser(prog="fourfold generate", description="Sample a continuation from a checkpoint.")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory or run directory (newest checkpoint)")
    p.add_argument("--prompt", required=True, help="text to continue (not empty)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="at least 1")
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy; at least 0")
    p.add_argument("--top-k", type=int, default=50, help="0 disables; at least 0")
    p.add_argument("--top-p", type=float, default=0.95, help="in (0, 1]; 1.0 disables")
    p.add_argument("--seed", type=int, default=0, help="in [0, 2^63)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    return p


def _check_sampling(a: argparse.Namespace) -> None:
    """Raise ConfigError, naming the flag, for a generate option outside its range."""
    if not a.prompt:
        raise ConfigError("--prompt is empty; give the text to continue, e.g. --prompt 'def '.")
    rules = [("--max-new-tokens", a.max_new_tokens, a.max_new_tokens >= 1, "a whole number of at least 1"),
             ("--temperature", a.temperature, math.isfinite(a.temperature) and a.temperature >= 0,
              "a finite number of at least 0 (0 is greedy)"),
             ("--top-k", a.top_k, a.top_k >= 0, "a whole number of at least 0 (0 disables it)"),
             ("--top-p", a.top_p, math.isfinite(a.top_p) and 0 < a.top_p <= 1, "a number in (0, 1] (1 disables it)"),
             ("--seed", a.seed, 0 <= a.seed < 2**63, "a whole number in [0, 2^63)")]
    for flag, value, ok, valid in rules:
        if not ok:
            raise ConfigError(f"{flag} {value} is out of range; set {flag} to {valid}.")


def cmd_generate(argv: list[str], console: Console) -> int:
    """`fourfold generate`: print the prompt and a sampled continuation from a checkpoint; return 0."""
    import torch

    from fourfold.distributed import pick_device
    from fourfold.infer.generate import SamplingOptions, find_checkpoint, generate_text

    a = _generate_parser().parse_args(argv)
    _check_sampling(a)  # before anything is loaded
    device = pick_device(a.device, flag="--device")
    checkpoint = find_checkpoint(a.checkpoint)
    opts = SamplingOptions(a.max_new_tokens, a.temperature, a.top_k, a.top_p, a.seed)
    torch.manual_seed(a.seed)
    text = generate_text(checkpoint, a.prompt, opts, device)
    print(a.prompt + text)
    return 0


def cmd_config(argv: list[str], console: Console) -> int:
    """`fourfold config`: print the config reference; return 0."""
    from fourfold.config_text import describe

    ArgumentParser(prog="fourfold config", description="Print every config key with its default, valid values "
                                                        "and meaning.").parse_args(argv)
    print(describe())
    sys.stdout.flush()  # a closed pipe (`fourfold config | head`) shows up here, inside main's handler
    return 0


COMMANDS = {"train": cmd_train, "generate": cmd_generate, "config": cmd_config}


def _report(error: FourfoldError) -> None:
    """Print a user error as one paragraph on stderr (prefixed with the rank on ranks other than 0)."""
    from rich.markup import escape

    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error[/]: {escape(prefix + str(error))}", highlight=False)


def _silence_stdout() -> None:
    """After the reader closed the pipe: send what is left to /dev/null so the exit flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (tests)
        pass


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand named in `argv`; return the exit code (2 for user errors, 130 on Ctrl-C)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    console = Console()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            from fourfold.errors import closest

            _report(ConfigError(f"Unknown command '{argv[0]}'.{closest(argv[0], COMMANDS)} "
                                f"Commands: {', '.join(COMMANDS)}; see `fourfold --help`."))
            return 2
        console.print(__doc__, markup=False, highlight=False)
        return 0
    try:
        return COMMANDS[argv[0]](argv[1:], console)
    except FourfoldError as e:
        _report(e)
        return 2
    except BrokenPipeError:
        _silence_stdout()
        return 0
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
