"""`fourfold config`: print every config key with its default, valid values and meaning."""

from __future__ import annotations

import sys

from rich.console import Console

from fourfold.cli.common import ArgumentParser


def main(argv: list[str], console: Console) -> int:
    """`fourfold config`: print the config reference; return 0."""
    from fourfold.config_text import describe

    ArgumentParser(prog="fourfold config", description="Print every config key with its default, valid values "
                                                        "and meaning.").parse_args(argv)
    print(describe())
    sys.stdout.flush()  # a closed pipe (`fourfold config | head`) shows up here, inside main's handler
    return 0
