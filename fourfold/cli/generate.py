"""`fourfold generate`: sample a continuation of a prompt from a checkpoint.

    fourfold generate --checkpoint runs/tiny --prompt "def " [--temperature 0.8 --top-k 50 --top-p 0.95]
"""

from __future__ import annotations

import argparse
import math

from rich.console import Console

from fourfold.cli.common import ArgumentParser
from fourfold.errors import ConfigError


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


def main(argv: list[str], console: Console) -> int:
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
