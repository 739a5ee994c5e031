"""Freezing the Python heap once a CUDA engine is built, so cyclic-GC runs skip what setup made (gc.freeze).

Building an engine (loading a checkpoint, capturing CUDA graphs) leaves ~300,000 tracked objects. Left as they
are, the garbage collector's first runs after setup traverse them inside the first requests: on an H200
(llama-1b, bench/generate.py; docs/benchmarks.md "Seventeenth session") single generation-0 and -1 runs took
3.8-7.4 ms, and a process's first 256-token request ran 24-31 us a step slower than the ones after it (1-7 us
with the freeze).
`freeze()` collects once and moves the survivors to the permanent generation. Frozen objects are never collected,
so a dropped engine (its runner and graphs hold it in reference cycles) would stay in GPU memory: `thaw()`, called
before the next engine is built, undoes this module's own freeze (never one made elsewhere) first.
"""

from __future__ import annotations

import gc

_frozen = False
"""Whether `freeze` ran since the last `thaw`."""


def freeze() -> None:
    """Collect, then freeze every object that survives."""
    global _frozen
    gc.collect()
    gc.freeze()
    _frozen = True


def thaw() -> None:
    """Undo `freeze` (all of gc's frozen objects, if this module froze them), so they can be collected again."""
    global _frozen
    if _frozen:
        gc.unfreeze()
        _frozen = False
