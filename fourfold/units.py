"""Formatting of quantities for people (bytes); the bottom layer, importable from anywhere."""

from __future__ import annotations


def format_bytes(n: float | None) -> str:
    """A byte count for people, e.g. '512 B' or '1.5 GiB'; '-' for None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
