"""Paged attention: the torch reference equals causal attention over each sequence's contiguous keys, and the
CPU step path (one plan per step, batched decodes) equals the reference on a mixed decode + prefill step."""

import pytest
import torch
import torch.nn.functional as F

from fourfold.infer.kv_pool import KVPool
from fourfold.infer.paged_attention import TorchAttentionPlan, PagedStep, paged_attention_reference
from fourfold.infer.step_tensors import StepTensors

HQ, HKV, D, BS, NUM_BLOCKS = 4, 2, 8, 4, 16


def scattered_sequences(lengths, new):
    """Random contiguous k/v per sequence, written into a pool through shuffled block tables."""
    torch.manual_seed(0)
    k_cache = torch.zeros(NUM_BLOCKS, BS, HKV, D, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(NUM_BLOCKS).tolist()
    max_blocks = max(-(-n // BS) for n in lengths)
    tables = torch.zeros(len(lengths), max_blocks, dtype=torch.int32)
    dense = []
    for i, n in enumerate(lengths):
        k, v = torch.randn(n, HKV, D, dtype=torch.float64), torch.randn(n, HKV, D, dtype=torch.float64)
        for b in range(-(-n // BS)):
            tables[i, b] = free.pop()
            rows = slice(b * BS, min((b + 1) * BS, n))
            k_cache[tables[i, b], :rows.stop - rows.start] = k[rows]
            v_cache[tables[i, b], :rows.stop - rows.start] = v[rows]
        dense.append((k, v))
    starts = torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(starts[-1]), HQ, D, dtype=torch.float64)
    return q, k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32), starts, dense


def dense_attention(q, dense, new):
    out, at = [], 0
    for (k, v), n in zip(dense, new):
        length = k.shape[0]
        mask = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
        o = F.scaled_dot_product_attention(q[at:at + n].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=mask, enable_gqa=True)
        out.append(o.transpose(0, 1))
        at += n
    return torch.cat(out)


LENGTHS, NEW = [9, 1, 13, 6], [1, 1, 5, 6]  # two decodes, a prefill chunk after cached tokens, a whole prompt


def test_reference_equals_dense_causal_attention():
    q, kc, vc, tables, lens, starts, dense = scattered_sequences(LENGTHS, NEW)
    got = paged_attention_reference(q, kc, vc, tables, lens, starts, D ** -0.5)
    torch.testing.assert_close(got, dense_attention(q, dense, NEW), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("lengths, new", [(LENGTHS, NEW), ([9, 1, 13], [1, 1, 1])], ids=["mixed", "decodes"])
def test_cpu_plan_equals_reference(lengths, new):
    q, kc, vc, tables, lens, starts, _ = scattered_sequences(lengths, new)
    st = StepTensors(torch.zeros(len(q), dtype=torch.long), torch.zeros(len(q), dtype=torch.long),
                     torch.zeros(len(q), dtype=torch.long), tables, lens, starts, torch.zeros(0, dtype=torch.long))
    plan = TorchAttentionPlan(st, BS)
    got = plan.attend(q, kc.view(-1, HKV, D), vc.view(-1, HKV, D), D ** -0.5)
    want = paged_attention_reference(q, kc, vc, tables, lens, starts, D ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_step_writes_new_keys_at_their_slots():
    pool = KVPool(1, 4, BS, HKV, D, torch.float64, torch.device("cpu"))
    slots = torch.tensor([2 * BS + 1, 0 * BS + 3])
    st = StepTensors(torch.zeros(2, dtype=torch.long), torch.tensor([5, 3]), slots,
                     torch.tensor([[1, 2], [0, 4]], dtype=torch.int32), torch.tensor([6, 4], dtype=torch.int32),
                     torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 1]))
    k, v = torch.randn(1, HKV, 2, D, dtype=torch.float64), torch.randn(1, HKV, 2, D, dtype=torch.float64)
    PagedStep(pool, st).attend(0, torch.randn(1, HQ, 2, D, dtype=torch.float64), k, v)
    keys, values = pool.layer(0)
    torch.testing.assert_close(keys[2, 1], k[0, :, 0])
    torch.testing.assert_close(values[0, 3], v[0, :, 1])
    assert keys[pool.scratch_block].abs().sum() == 0
