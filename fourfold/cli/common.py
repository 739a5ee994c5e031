"""What subcommands share: an argparse parser whose usage errors are one-paragraph user errors, and relaunching
a command under torchrun."""

from __future__ import annotations

import argparse
import sys

from fourfold.errors import ConfigError


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are ConfigErrors: one paragraph and exit code 2, like every user mistake."""

    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message}. See `{self.prog} --help`.")


def without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """`argv` without the options in `flags` (each taking one value, as `--flag V` or `--flag=V`)."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f"{f}=" for f in flags)):
            rest.append(a)
    return rest


def launch_torchrun(command: str, nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Re-run `fourfold <command> <argv>` under torchrun (in this process, as `torchrun` itself does).

    A worker that stops on a user error prints its one paragraph and exits with 2; this returns 2 then
    instead of letting torchrun print its own traceback.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
                        "-m", "fourfold", command, *argv]))
    except ChildFailedError as e:
        if any(f.exitcode == 2 for f in e.failures.values()):
            return 2  # the worker has said what to change
        print(e.format_msg(), file=sys.stderr)
        return 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0
