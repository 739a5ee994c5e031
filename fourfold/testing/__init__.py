"""Helpers shared by the test suite and bench/: the layout parity table, a tiny trainer config and corpus,
a per-rank training target, and readers for what a run leaves behind (losses, gradient norms, weights).

Nothing in fourfold imports this package; it sits in the top layer, beside the command line.
"""

from fourfold.testing.layouts import (LAYOUTS, PARITY_OVERRIDES, PARITY_STEPS, PARITY_TOLERANCE, ParityLayout,
                                      model_overrides)
from fourfold.testing.runs import (TINY_MODEL, final_weights, grad_norms, losses, tiny_config, train_on_rank,
                                   write_corpus)

__all__ = ["LAYOUTS", "PARITY_OVERRIDES", "PARITY_STEPS", "PARITY_TOLERANCE", "ParityLayout", "model_overrides",
           "TINY_MODEL", "final_weights", "grad_norms", "losses", "tiny_config", "train_on_rank", "write_corpus"]
