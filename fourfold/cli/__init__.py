"""The `fourfold` command line: one module of this package per subcommand, found by name.

    fourfold train --config configs/tiny.toml --out runs/tiny [--resume [PATH]] [--nproc N] [--section.key value ...]
    torchrun --standalone --nproc-per-node 4 -m fourfold train --config configs/tiny.toml --parallel.fsdp 4
    fourfold generate --checkpoint runs/tiny --prompt "def "
    fourfold config            # every config key with its default, valid values and meaning

User mistakes (a missing file, an unknown key, a value out of range, an impossible layout, an unwritable
run directory, a corrupt checkpoint) end with a one-paragraph message saying what to change and exit
code 2, without a traceback, before any work starts: `train --nproc N` checks the layout against N
before it launches torchrun. A subcommand is a module here with a `main(argv, console) -> int`; the first
line of its docstring is its summary in `fourfold --help`.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import pkgutil
import sys
from pathlib import Path

from rich.console import Console

from fourfold.errors import ConfigError, FourfoldError

# Modules of this package that are helpers, not subcommands.
NOT_COMMANDS = {"common"}


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


def commands() -> dict[str, str]:
    """Subcommand name -> the first line of its module's docstring; each is a module of this package."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name not in NOT_COMMANDS and not info.name.startswith("_"):
            spec = importlib.util.find_spec(f"{__name__}.{info.name}")
            doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""
            found[info.name] = doc.splitlines()[0].split(": ", 1)[-1] if doc else ""
    order = {name: i for i, name in enumerate(("train", "generate", "serve", "convert", "quantize", "eval", "plan",
                                               "config"))}
    return dict(sorted(found.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


def _usage(names: dict[str, str]) -> str:
    lines = [__doc__.rstrip(), "", "Commands:"]
    lines += [f"    {name:<10} {summary}" for name, summary in names.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand named in `argv`; return the exit code (2 for user errors, 130 on Ctrl-C)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    console = Console()
    names = commands()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in names:
        if argv and argv[0] not in ("-h", "--help"):
            from fourfold.errors import closest

            _report(ConfigError(f"Unknown command '{argv[0]}'.{closest(argv[0], names)} "
                                f"Commands: {', '.join(names)}; see `fourfold --help`."))
            return 2
        console.print(_usage(names), markup=False, highlight=False)
        return 0
    try:
        return importlib.import_module(f"{__name__}.{argv[0]}").main(argv[1:], console)
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
