"""The captured graphs' packed input buffer: one byte buffer with int64 and int32 views, filled in full on the host."""

from __future__ import annotations

import numpy as np
import torch

from fourfold.infer.cuda_graphs import StaticDecodeInputs
from fourfold.infer.packed_inputs import PackedInputs
from fourfold.infer.prefill_graphs import StaticPrefillInputs


def test_one_copy_of_the_host_array_fills_both_views():
    packed = PackedInputs(3, 5, torch.device("cpu"))
    host = packed.host_array()
    wide, narrow = packed.host_views(host)
    wide[:] = [-1, 2 ** 40, 7]
    narrow[:] = [3, -4, 5, 2 ** 31 - 1, 0]
    packed.data.copy_(torch.from_numpy(host))
    assert packed.data.numel() == 3 * 8 + 5 * 4
    assert packed.wide.tolist() == [-1, 2 ** 40, 7] and packed.narrow.tolist() == [3, -4, 5, 2 ** 31 - 1, 0]


def stale_host_arrays(monkeypatch, fill: int) -> None:
    """Make every host array start as `fill` bytes (a reused pinned buffer holds the last step's bytes)."""
    monkeypatch.setattr(PackedInputs, "host_array", lambda self: np.full(self.nbytes, fill, dtype=np.uint8))


def test_decode_and_prefill_host_bytes_overwrite_every_byte(monkeypatch):
    decode = StaticDecodeInputs(batch=4, max_blocks=6, scratch_block=9, block_size=4, device=torch.device("cpu"))
    prefill = StaticPrefillInputs(size=8, max_blocks=6, scratch_block=9, block_size=4, device=torch.device("cpu"))
    i64 = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    decode_step = (i64(5, 6), i64(3, 9), i64(13, 38), np.array([[3, 3, 3], [8, 8, 8]], dtype=np.int32),
                   np.array([4, 10], dtype=np.int32))
    prefill_step = (i64(1, 2, 3), i64(4, 5, 6), i64(17, 18, 19), np.array([[4, 5]], dtype=np.int32),
                    np.array([7], dtype=np.int32), np.array([0, 3], dtype=np.int32), i64(2))
    results = []
    for fill in (0, 0xAB, 0xFF):
        stale_host_arrays(monkeypatch, fill)
        results.append((decode.host_bytes(*decode_step).copy(), prefill.host_bytes(*prefill_step).copy()))
    for other in results[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(results[0], other))
    wide, narrow = decode.packed.host_views(results[0][0])
    assert wide.tolist() == [5, 6, 0, 0, 3, 9, 0, 0, 13, 38, 36, 36]  # padded rows: token 0, scratch slot 9 * 4
    assert narrow[:12].tolist() == [3, 3, 3, 9, 9, 9, 8, 8, 8, 9, 9, 9] and narrow[-4:].tolist() == [4, 10, 1, 1]
    wide, narrow = prefill.packed.host_views(np.concatenate(
        [results[0][1], np.zeros(prefill.packed.nbytes - len(results[0][1]), np.uint8)]))
    assert wide[:8].tolist() == [1, 2, 3, 0, 0, 0, 0, 0] and wide[24] == 2   # tokens, then the sampled row
    assert narrow[:2].tolist() == [7, 5] and narrow[2:5].tolist() == [0, 3, 8]   # lengths, query starts (2 slots)
    assert narrow[5:17].tolist() == [4, 5, 9, 9, 9, 9] + [9] * 6   # the step's table row, the padding sequence's
