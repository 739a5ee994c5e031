"""The Triton paged attention against a plain torch reference of the contract, run by Triton's CPU interpreter.

Without a GPU the kernels run under TRITON_INTERPRET=1 (numpy on the CPU; tests/conftest.py sets it before
anything imports triton); with one they run on it.
Skipped when Triton is not installed (an optional dependency: CPU installs use the engine's torch reference).
"""

from __future__ import annotations

import torch

from tests.triton_device import DEVICE, require_triton_runtime

require_triton_runtime()
from fourfold.infer import attention_gpu  # noqa: E402 - after the checks above


def reference(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale):
    """The contract spelled out: gather each sequence's pages, causal softmax per query, GQA by head // group."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    block_size = k_cache.shape[1]
    for i in range(block_tables.shape[0]):
        begin, end = int(query_start[i]), int(query_start[i + 1])
        length, n = int(seq_lens[i]), end - begin
        if n == 0:
            continue
        positions = torch.arange(length)
        blocks = block_tables[i].long()[positions // block_size]
        k = k_cache[blocks, positions % block_size].float().repeat_interleave(group, dim=1)  # (L, hq, d)
        v = v_cache[blocks, positions % block_size].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[begin:end].float(), k) * scale
        query_pos = length - n + torch.arange(n)
        scores = scores.masked_fill(positions[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[begin:end] = torch.einsum("htl,lhd->thd", scores.softmax(-1), v).to(q.dtype)
    return out


def make_case(query_lens, seq_lens, *, hq=4, hkv=2, d=16, block_size=16, max_blocks=None, seed=0,
              dtype=torch.float32):
    """Random pool and queries; each sequence's pages are a shuffled, non-contiguous set of blocks."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    max_blocks = max_blocks or max(needed)
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, count in enumerate(needed):
        tables[i, :count] = order[used:used + count].int()
        used += count
    q = torch.randn(sum(query_lens), hq, d, generator=gen).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    starts = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), starts, d ** -0.5)
    return tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)


def check(args, atol=1e-4):
    got = attention_gpu.paged_attention(*args)
    expected = reference(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    assert got.shape == expected.shape and got.dtype == expected.dtype
    rtol = 1e-3
    if DEVICE == "cuda" and got.dtype == torch.float32:
        atol = rtol = max(atol, 2e-3)   # float32 tl.dot runs in TF32 on the GPU; the reference in float32
    torch.testing.assert_close(got.cpu().float(), expected.float(), atol=atol, rtol=rtol)


def test_decode_one_query_per_sequence_with_split_kv():
    # A wide block table leaves many chunks, so the decode path splits the KV range and combines.
    check(make_case([1, 1, 1], [5, 40, 70], max_blocks=8))


def test_decode_single_sequence_block_size_not_a_power_of_two():
    check(make_case([1], [37], block_size=12, hq=6, hkv=2, d=24))


def test_prefill_whole_prompts_ragged():
    check(make_case([19, 7], [19, 7], hq=8, hkv=2))


def test_mixed_step_chunked_prefill_next_to_decodes():
    # Sequence 0 decodes, 1 prefills a middle chunk of a longer prompt, 2 prefills a chunk ending its prompt.
    check(make_case([1, 21, 9, 1], [33, 50, 9, 64], hq=4, hkv=1))


def test_multi_query_attention_and_half_precision():
    check(make_case([3, 1], [20, 17], hq=4, hkv=4, dtype=torch.float16), atol=2e-3)


def test_split_count_from_shapes_only():
    assert attention_gpu.available()
    # The number of tiles comes from shapes; surplus prefill tiles point past their sequence's queries.
    starts = torch.tensor([0, 3, 20], dtype=torch.int32)
    seq, first, count = attention_gpu._tiles(starts, 20, 8)
    assert count == 20 // 8 + 1 + 2
    real = [(s, f) for s, f in zip(seq.tolist(), first.tolist()) if f < (starts[s + 1] - starts[s])]
    assert real == [(0, 0), (1, 0), (1, 8), (1, 16)]


def test_tiles_recomputed_when_query_start_changes_in_place():
    # Layers of one step share the tiles of one query_start tensor; an in-place change must not reuse them.
    args = list(make_case([2, 0, 1], [20, 9, 5]))  # 3 queries of 3 sequences: one-token tiles
    check(tuple(args))
    args[5][1:3] = torch.tensor([1, 2], dtype=torch.int32)  # now one query each
    check(tuple(args))


def test_the_engine_runs_its_gpu_kernels_only_on_cuda_in_the_dtypes_they_take():
    """float64 models on a GPU (the parity tests' reference precision) take torch's attention: the kernels sum in
    float32 and do not compile for float64."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert attention_gpu.runs_on(cuda, dtype) and not attention_gpu.runs_on(cpu, dtype)
    assert not attention_gpu.runs_on(cuda, torch.float64)
