"""One device byte buffer holding a captured step's int64 and int32 inputs, so a staged step goes up in one copy.

    packed = PackedInputs(n_wide=3 * batch, n_narrow=batch * max_blocks + batch, device=device)
    packed.wide, packed.narrow               # int64 and int32 views of packed.data (the graph reads these)
    host = packed.host_array()               # a numpy uint8 array laid out as packed.data
    wide, narrow = packed.host_views(host)   # fill these, then copy `host` into packed.data in one go

The captured graphs of fourfold.infer.cuda_graphs and fourfold.infer.prefill_graphs each read a step from such a
buffer. At one sequence a decode step's host work is what bounds the int4 model's step (H200, llama-1b: ~0.5 ms
of graph), and each copy from pinned memory costs the host tens of microseconds (the copy, its ring buffer's event),
so the two parts travel together.
"""

from __future__ import annotations

import numpy as np
import torch


class PackedInputs:
    """`n_wide` int64 values, then `n_narrow` int32 values, in one uint8 tensor on `device`."""

    def __init__(self, n_wide: int, n_narrow: int, device: torch.device):
        self.wide_bytes = 8 * n_wide
        self.nbytes = self.wide_bytes + 4 * n_narrow
        self.data = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self.wide = self.data[:self.wide_bytes].view(torch.int64)
        self.narrow = self.data[self.wide_bytes:].view(torch.int32)

    def host_array(self) -> np.ndarray:
        """An uninitialised host array of `data`'s layout."""
        return np.empty(self.nbytes, dtype=np.uint8)

    def host_views(self, host: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The int64 and int32 parts of a host array of `data`'s layout, as numpy views to fill."""
        return host[:self.wide_bytes].view(np.int64), host[self.wide_bytes:self.nbytes].view(np.int32)
