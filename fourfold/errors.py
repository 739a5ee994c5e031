"""User-facing errors: one exception type whose message says what went wrong and what to change.

The CLI catches `FourfoldError` and prints its message as one paragraph instead of a traceback.
"""

from __future__ import annotations

import difflib


class FourfoldError(Exception):
    """An error caused by the user's input (config, layout, files), not by a bug in fourfold."""


class ConfigError(FourfoldError):
    """A config key, value or combination of values is invalid."""


class LayoutError(ConfigError):
    """A parallel layout does not fit the world size or the model; raised before any process group exists."""


class TrainingError(FourfoldError):
    """Training cannot go on as configured (e.g. too many NaN/inf steps in a row); the message says what to change."""


class CheckpointError(FourfoldError):
    """A checkpoint is missing, truncated or does not match the model or optimizer it is loaded into."""


def closest(word: str, choices) -> str:
    """Return ' Did you mean X?' for the closest choice to `word`, or '' when nothing is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""
