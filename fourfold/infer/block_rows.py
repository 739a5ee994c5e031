"""Every sequence's block table kept as a row of one int32 array, so a step gathers its tables in one index op.

The block manager (fourfold.infer.block_manager) writes a block here whenever it appends one to a
sequence's `block_table` list and frees the row when the sequence lets its blocks go; the model runner
then builds a step's (S, max_blocks) table tensor with `gather` instead of padding S Python lists.
Unused entries hold `fill` (the pool's scratch block), the padding the attention kernels expect. The
array grows (rows and columns) as needed, so it needs neither the batch size nor the context length.
"""

from __future__ import annotations

import numpy as np


class BlockRows:
    """Rows of block ids, one per sequence holding blocks (`Sequence.table_row`, -1 for none)."""

    def __init__(self, fill: int, rows: int = 16, width: int = 8):
        self.fill = fill
        self.array = np.full((rows, width), fill, dtype=np.int32)
        self._free_rows = list(range(rows - 1, -1, -1))

    def append(self, seq, block: int) -> None:
        """Mirror `seq.block_table.append(block)` (call it after the append)."""
        row = seq.table_row
        if row < 0:
            if not self._free_rows:
                self._grow(rows=2 * self.array.shape[0])
            row = seq.table_row = self._free_rows.pop()
        col = len(seq.block_table) - 1
        if col >= self.array.shape[1]:
            self._grow(width=max(2 * self.array.shape[1], col + 1))
        self.array[row, col] = block

    def release(self, seq) -> None:
        """Free `seq`'s row (call it before its block_table is emptied)."""
        row = seq.table_row
        if row >= 0:
            self.array[row, :len(seq.block_table)] = self.fill
            self._free_rows.append(row)
            seq.table_row = -1

    def gather(self, rows: list[int], width: int) -> np.ndarray:
        """The (len(rows), width) table of those rows, padded with `fill` past each sequence's blocks."""
        if width > self.array.shape[1]:
            self._grow(width=width)
        return self.array[np.asarray(rows, dtype=np.intp), :width]

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        old = self.array
        new_rows, new_width = rows or old.shape[0], width or old.shape[1]
        self.array = np.full((new_rows, new_width), self.fill, dtype=np.int32)
        self.array[:old.shape[0], :old.shape[1]] = old
        self._free_rows = list(range(new_rows - 1, old.shape[0] - 1, -1)) + self._free_rows
