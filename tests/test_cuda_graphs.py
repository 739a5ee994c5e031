"""Decode graphs' CPU-visible logic: batch-size buckets, and padded steps that give the unpadded step's logits."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fourfold.infer.cuda_graphs import DecodeGraphs, batch_sizes_up_to, bucket_for

BLOCK_SIZE, NUM_BLOCKS, HEADS, DIM, VOCAB = 4, 16, 2, 8, 11


def test_buckets():
    assert batch_sizes_up_to(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert batch_sizes_up_to(256)[-1] == 256 and batch_sizes_up_to(3, (1, 2, 4)) == [1, 2, 3]
    sizes = batch_sizes_up_to(64)
    assert [bucket_for(n, sizes) for n in (1, 3, 8, 9, 33, 64)] == [1, 4, 8, 16, 48, 64]
    with pytest.raises(ValueError):
        bucket_for(65, sizes)


class ToyModel:
    """Embeds tokens, writes k/v into a paged pool at the slot mapping, attends over each sequence's pages."""

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.emb = torch.randn(VOCAB, 3, HEADS, DIM, generator=gen)
        self.head = torch.randn(HEADS * DIM, VOCAB, generator=gen)
        self.k_pool = torch.zeros(NUM_BLOCKS + 1, BLOCK_SIZE, HEADS, DIM)  # the last block is scratch
        self.v_pool = torch.zeros_like(self.k_pool)

    def forward(self, tokens, positions, slot_mapping, block_tables, seq_lens, query_start, logits_for):
        q, k, v = (self.emb[tokens][:, i] + positions[:, None, None] * 0.01 for i in range(3))
        self.k_pool.view(-1, HEADS, DIM).index_copy_(0, slot_mapping, k)
        self.v_pool.view(-1, HEADS, DIM).index_copy_(0, slot_mapping, v)
        out = torch.empty_like(q)
        for i in range(seq_lens.shape[0]):
            pos = torch.arange(int(seq_lens[i]))
            blocks = block_tables[i].long()[pos // BLOCK_SIZE]
            keys, values = self.k_pool[blocks, pos % BLOCK_SIZE], self.v_pool[blocks, pos % BLOCK_SIZE]
            row = int(query_start[i])
            weights = torch.einsum("hd,lhd->hl", q[row], keys).softmax(-1)
            out[row] = torch.einsum("hl,lhd->hd", weights, values)
        return out.reshape(out.shape[0], -1)[logits_for] @ self.head


def decode_step(lengths: list[int], tables: list[list[int]], tokens: list[int]) -> SimpleNamespace:
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [NUM_BLOCKS] * (width - len(t)) for t in tables], dtype=torch.int32)
    positions = torch.tensor([n - 1 for n in lengths])
    slots = torch.tensor([t[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for t, n in zip(tables, lengths)])
    return SimpleNamespace(tokens=torch.tensor(tokens), positions=positions, slot_mapping=slots,
                           block_tables=block_tables, seq_lens=torch.tensor(lengths, dtype=torch.int32),
                           query_start=torch.arange(len(lengths) + 1, dtype=torch.int32),
                           logits_for=torch.arange(len(lengths)))


def fields(st) -> tuple:
    return (st.tokens, st.positions, st.slot_mapping, st.block_tables, st.seq_lens, st.query_start, st.logits_for)


def test_padded_steps_match_the_unpadded_step_and_touch_only_scratch():
    model = ToyModel()
    model.k_pool[:NUM_BLOCKS].normal_(generator=torch.Generator().manual_seed(1))  # earlier tokens' keys
    model.v_pool[:NUM_BLOCKS].normal_(generator=torch.Generator().manual_seed(2))
    graphs = DecodeGraphs(model.forward, max_batch=8, max_blocks=5, block_size=BLOCK_SIZE,
                          scratch_block=NUM_BLOCKS, device=torch.device("cpu"), batch_sizes=(1, 2, 4, 8))
    graphs.capture()  # nothing to capture on CPU
    big = decode_step([9, 3, 5, 14, 2, 4, 6], [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10], [11], [12, 13]],
                      [1, 2, 3, 4, 5, 6, 7])
    small = decode_step([10, 6, 7, 3, 2], [[0, 1, 2], [4, 5], [11, 3], [14], [15]], [7, 8, 9, 10, 1])
    one = decode_step([11], [[0, 1, 2]], [3])
    for st in (big, small, one):  # the second step pads rows the first one filled (both in the 8 bucket)
        assert graphs.can_run(st)
        saved_k = model.k_pool.clone()
        expected = model.forward(*fields(st))
        model.k_pool.copy_(saved_k)
        got = graphs.run(st)
        assert got.shape == (st.seq_lens.shape[0], VOCAB)
        torch.testing.assert_close(got, expected)
        changed = (model.k_pool != saved_k).flatten(1).any(1).nonzero().flatten().tolist()
        real_blocks = {int(t[(int(n) - 1) // BLOCK_SIZE]) for t, n in zip(st.block_tables, st.seq_lens)}
        assert set(changed) - real_blocks <= {NUM_BLOCKS}  # padding wrote only to the scratch block
    prefill = SimpleNamespace(**{**vars(small), "tokens": torch.tensor([1, 2, 3, 4]),
                                 "query_start": torch.tensor([0, 2, 3, 4], dtype=torch.int32)})
    assert not graphs.can_run(prefill)
    too_wide = decode_step([30], [[0, 1, 2, 3, 4, 5, 6, 7]], [1])
    assert not graphs.can_run(too_wide)


def host_arrays(st) -> tuple:
    """A step as host_step's seven numpy arrays."""
    return tuple(t.numpy() for t in fields(st))


def cpu_upload(values: np.ndarray, dtype: torch.dtype, out: torch.Tensor) -> torch.Tensor:
    return out[:len(values)].copy_(torch.from_numpy(values))


def test_staged_steps_run_without_a_load_and_give_the_argmax():
    model = ToyModel()
    model.k_pool[:NUM_BLOCKS].normal_(generator=torch.Generator().manual_seed(3))
    model.v_pool[:NUM_BLOCKS].normal_(generator=torch.Generator().manual_seed(4))
    graphs = DecodeGraphs(model.forward, max_batch=8, max_blocks=5, block_size=BLOCK_SIZE,
                          scratch_block=NUM_BLOCKS, device=torch.device("cpu"), batch_sizes=(1, 2, 4, 8))
    big = decode_step([9, 3, 5, 14, 2, 4, 6], [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10], [11], [12, 13]],
                      [1, 2, 3, 4, 5, 6, 7])
    small = decode_step([10, 6, 7, 3, 2], [[0, 1, 2], [4, 5], [11, 3], [14], [15]], [7, 8, 9, 10, 1])
    for st in (big, small):  # the small step must re-pad the rows the big one filled (both in the 8 bucket)
        staged = graphs.stage(host_arrays(st), cpu_upload)
        inputs = graphs.inputs[8]
        assert inputs.holds(staged) and staged.block_tables.shape == (len(st.seq_lens), 5)
        inputs.load = None  # run must not load a staged step
        saved_k = model.k_pool.clone()
        expected = model.forward(*fields(st))
        model.k_pool.copy_(saved_k)
        got = graphs.run(staged)
        torch.testing.assert_close(got, expected)
        assert torch.equal(graphs.greedy_ids(), expected.argmax(dim=-1))
        n = len(st.seq_lens)
        assert inputs.tokens[n:].eq(0).all() and inputs.positions[n:].eq(0).all()
        assert inputs.slot_mapping[n:].eq(NUM_BLOCKS * BLOCK_SIZE).all() and inputs.seq_lens[n:].eq(1).all()
        assert inputs.block_tables[n:].eq(NUM_BLOCKS).all() and inputs.block_tables[:n, 4].eq(NUM_BLOCKS).all()
        del inputs.load
    prefill = SimpleNamespace(**{**vars(small), "tokens": torch.tensor([1, 2, 3, 4, 5, 6]),
                                 "positions": torch.arange(6), "slot_mapping": torch.arange(6),
                                 "query_start": torch.tensor([0, 2, 3, 4, 5, 6], dtype=torch.int32)})
    assert graphs.stage(host_arrays(prefill), cpu_upload) is None
    assert graphs.stage(host_arrays(decode_step([30], [[0, 1, 2, 3, 4, 5, 6, 7]], [1])), cpu_upload) is None
