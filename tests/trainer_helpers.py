"""Shared set-up for tests that run the real trainer: fourfold.testing's tiny config, corpus, rank target and
result readers, re-exported under the names the tests import, plus the parity assertion the layout tests share."""

from __future__ import annotations

from pathlib import Path

import torch

from fourfold.testing import (PARITY_STEPS, PARITY_TOLERANCE, TINY_MODEL, final_weights, grad_norms, losses,
                              tiny_config, train_on_rank, write_corpus)

__all__ = ["TINY_MODEL", "write_corpus", "tiny_config", "train_on_rank", "losses", "grad_norms", "final_weights",
           "run_results", "assert_matches_reference"]


def run_results(run_dir: Path) -> dict:
    """What a parity comparison reads from a run directory: per-step losses and gradient norms, final weights."""
    return {"losses": losses(run_dir), "grad_norms": grad_norms(run_dir), "weights": final_weights(run_dir)}


def assert_matches_reference(run_dir: Path, ref: dict, check_grad_norm: bool = True, steps: int = PARITY_STEPS) -> None:
    """The layout parity check: `steps` losses, gradient norms (optional) and final weights equal `ref`'s
    (a `run_results` dict) within fourfold.testing's PARITY_TOLERANCE."""
    got = run_results(run_dir)
    assert len(got["losses"]) == steps
    rtol, atol = PARITY_TOLERANCE["loss"]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=atol)
    if check_grad_norm:
        # The gradient norm exposes a wrong reduction (a sum not divided, a missing all-reduce) that AdamW's
        # scale invariance and clipping would hide from the weights.
        rtol, atol = PARITY_TOLERANCE["grad_norm"]
        torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]),
                                   rtol=rtol, atol=atol)
    assert got["weights"].keys() == ref["weights"].keys()
    rtol, atol = PARITY_TOLERANCE["weight"]
    for key, value in ref["weights"].items():
        torch.testing.assert_close(got["weights"][key], value, rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")
