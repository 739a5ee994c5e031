"""What every subcommand shares: an argparse parser whose usage errors are one-paragraph user errors."""

from __future__ import annotations

import argparse

from fourfold.errors import ConfigError


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are ConfigErrors: one paragraph and exit code 2, like every user mistake."""

    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message}. See `{self.prog} --help`.")
