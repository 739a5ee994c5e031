"""Decode-step attention in two Triton kernels: rotary + KV-cache write + split-KV paged attention, then the combine.

    out = decode_attention(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                           scale, n_heads, n_kv_heads)

For steps with exactly one query per sequence (T == S, token i of sequence i), the same result as
    q = fused_ops.rotary_kv_write(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, hq, hkv)
    out = attention_gpu.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale)
(same tensor contracts, same pool afterwards) from two launches instead of three: the rotary kernel goes.

How it runs: the attention kernel is attention_gpu's decode branch with the rotary in front. The grid is
(T, hkv, splits), the split count attention_gpu.decode_splits of the shapes (so both paths split alike, and
a step can be captured in a CUDA graph). Each program loads its kv head's GROUP = hq / hkv query heads, the
new key and the new value from the q|k|v row and rotates q and k with fused_ops.rotate_rounded, bit for bit
the old path's. Split 0 writes the new key and value to the pool slot, as rotary_kv_write does. Programs of
other splits may run before that write lands, so no program reads the current position (seq_len - 1) from
the pool: the chunk that holds it swaps the new k / v row in from registers (attention_gpu.load_chunk and
attend_chunk with NEW_KV_IN_REGISTERS). The online softmax over the split's chunks, the partials and log-sum-exps (in
attention_gpu.split_buffers' layout) and the combine (attention_gpu.combine_splits, one program per (token,
head), skipped for one split) are attention_gpu's own, so with the same split count the output equals the
old path's up to how the compiler schedules the same operations. Padded graph rows (position 0, seq_len 1,
slot in the scratch block) read nothing from the pool and write only their own scratch slot.

Only the q|k|v row comes from the previous kernel (the q|k|v projection). The host staged the step's lengths,
positions and block tables, and earlier steps wrote the pool rows below seq_len - 1 (a step's kernels start after
its input copies, which wait for all earlier work), so each program loads those, the rotary tables and its first
chunk's keys and values before its programmatic-launch wait (attention_gpu.load_chunk, then
attention_gpu.attend_chunk on the loaded tiles, attend_chunks for the rest). At batch 1 a split holds one chunk,
so after the wait a program reads only the q|k|v row: 4.2-6.1 against 4.8-7.2 us a layer at contexts 128-2048
(H200, llama-1b shapes, bench/decode_attention_check.py; bench/results/2026-11-24-h200-host-step/).

Why not one kernel: an earlier version did the combine in the attention kernel too (the last split to
finish, found with an atomic ticket on per-(token, kv head) counters after gpu-scope fences, read all the
partials and wrote the output). On an H200 (llama-1b attention: hq 32, hkv 4, d 64, bf16; 22 layers per
CUDA graph) it was 2.5x slower than the three kernels: 13.3-14.7 against 5.4-5.8 us a layer at batch 1
(contexts 128..1024), 75 against 50 us at batch 64 and context 2048 (likely the serial combine tail of one
program per (token, kv head), fences and atomics on the critical path, and a split target of its own;
bench/results/2026-11-24-h200-decode-attention/). This path saves the one dependent launch that costs
nothing to drop and keeps the rest of the old path: 4.4-4.8 against 5.3-5.8 us a layer at batch 1
(bench/results/2026-11-24-h200-decode-attention-v2/), used up to MAX_TOKENS sequences
(fused_decoder.FUSED_DECODE_ATTENTION switches it).
"""

from __future__ import annotations

import torch

from fourfold.infer.attention_gpu import DECODE_BLOCK_N, combine_splits, decode_splits, split_buffers
from fourfold.ops.triton_launch import pdl, triton


MAX_TOKENS = 8
"""Decode steps of at most this many sequences take this path (fourfold.infer.model_runner); larger ones the
three kernels. H200, llama-1b shapes, 22 layers in a graph (bench/decode_attention_check.py): 1.2-1.3x faster
at 1-4 sequences, even at 16 x 512 positions, 0.71-0.91x at 16-64 sequences with long contexts (every split
repeats the rotary of its query heads, and the register swap costs each chunk)."""


def available() -> bool:
    """Whether Triton imported, so `decode_attention` can run (on CUDA, or under TRITON_INTERPRET=1)."""
    return triton is not None


def supports(head_dim: int, n_heads: int, n_kv_heads: int) -> bool:
    """Whether the kernel handles these head shapes: a power-of-two head_dim of 16..256, hq a multiple of hkv."""
    group = n_heads // max(n_kv_heads, 1)
    return (available() and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and n_kv_heads > 0
            and group * n_kv_heads == n_heads and group <= 64)


if triton is not None:
    import triton.language as tl

    from fourfold.infer.attention_gpu import attend_chunk, attend_chunks, load_chunk, softmax_start, store_split
    from fourfold.infer.fused_ops import rotate_rounded
    from fourfold.ops.triton_launch import pdl_signal, pdl_wait

    @triton.jit
    def _rotated(row_ptr, dims, partner, first_half, c, s, mask):
        """Rotary of the (rows, d) heads at row_ptr + dims, rounded like fused_ops._rotary_kv_kernel."""
        x = tl.load(row_ptr + dims, mask=mask, other=0.0)
        xp = tl.load(row_ptr + partner, mask=mask, other=0.0)
        return rotate_rounded(x, tl.where(first_half, -xp, xp), c, s)

    @triton.jit
    def _decode_attention_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
                                 block_tables_ptr, seq_lens_ptr, scale, max_blocks,
                                 stride_qkv, stride_cos, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                 stride_vh, stride_ot, stride_oh, stride_os, stride_bt,
                                 HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                                 G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                                 SPLITS: tl.constexpr, PDL: tl.constexpr):
        pdl_signal(PDL)
        token, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        # Before the wait, all but the q|k|v row: the host staged the step's inputs and earlier steps wrote the
        # pool rows read here (positions below seq_len - 1), so the first chunk's k / v and the rotary tables
        # are in flight while the previous kernel finishes.
        seq_len = tl.load(seq_lens_ptr + token)
        pos = tl.load(pos_ptr + token)
        dims = tl.arange(0, HEAD_DIM)
        dim_valid = dims < HEAD_DIM
        dt = qkv_ptr.dtype.element_ty
        c = tl.load(cos_ptr + pos * stride_cos + dims).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_cos + dims).to(dt).to(tl.float32)
        # attention_gpu._attend_kernel's decode branch (one-token tile, kv_len = seq_len), current k / v swapped in
        chunks = tl.cdiv(seq_len, BLOCK_N)
        per_split = tl.cdiv(chunks, SPLITS)
        chunk_begin = split * per_split
        chunk_end = tl.minimum(chunks, chunk_begin + per_split)
        k_head, v_head = k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh
        table = block_tables_ptr + token * stride_bt
        k_first, v_first = load_chunk(k_head, v_head, table, chunk_begin, seq_len, max_blocks, stride_kb, stride_ks,
                                      stride_vb, stride_vs, dims, dim_valid, BLOCK_N, BLOCK_SIZE, True)
        pdl_wait(PDL)
        first_half = dims < HEAD_DIM // 2
        partner = (dims + HEAD_DIM // 2) % HEAD_DIM  # the element rotate_half pairs with
        row = qkv_ptr + token * stride_qkv
        rows = tl.arange(0, G_PAD)
        row_valid = rows < GROUP
        head = kv_head * GROUP + rows
        q = _rotated(row + head[:, None] * HEAD_DIM, dims[None, :], partner[None, :], first_half[None, :],
                     c[None, :], s[None, :], row_valid[:, None])
        k_new = _rotated(row + (HQ + kv_head) * HEAD_DIM, dims, partner, first_half, c, s,
                         dim_valid).to(k_ptr.dtype.element_ty)
        v_new = tl.load(row + (HQ + HKV + kv_head) * HEAD_DIM + dims).to(v_ptr.dtype.element_ty)
        if split == 0:  # the pool write of rotary_kv_write; nobody in this launch reads it back
            slot = tl.load(slot_ptr + token)
            page, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            tl.store(k_ptr + page * stride_kb + offset * stride_ks + kv_head * stride_kh + dims, k_new)
            tl.store(v_ptr + page * stride_vb + offset * stride_vs + kv_head * stride_vh + dims, v_new)
        # An empty split's first chunk lies past seq_len: every position masked, so that step changes nothing.
        position = tl.full([G_PAD], seq_len - 1, tl.int32)
        acc, m_i, l_i = softmax_start(G_PAD, HEAD_DIM)
        acc, m_i, l_i = attend_chunk(q, k_first, v_first, chunk_begin, seq_len, position, scale, acc, m_i, l_i,
                                     k_new, v_new, BLOCK_N, True)
        acc, m_i, l_i = attend_chunks(q, k_head, v_head, table, chunk_begin + 1, chunk_end, seq_len, position, scale,
                                      max_blocks, stride_kb, stride_ks, stride_vb, stride_vs, dims, dim_valid, k_new,
                                      v_new, acc, m_i, l_i, BLOCK_N, BLOCK_SIZE, True)
        store_split(acc, m_i, l_i, out_ptr, lse_ptr, token, head, dims, split, stride_ot, stride_oh, stride_os,
                    row_valid, dim_valid, SPLITS)


def decode_attention(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, n_heads: int,
                     n_kv_heads: int, splits: int | None = None) -> torch.Tensor:
    """Rotary + KV write + paged attention of a decode step (one query per sequence); see the module docstring.

    `splits` forces the split count (a power of two; tests and the bench's sweep); by default
    attention_gpu.decode_splits of the shapes, as paged_attention splits.
    """
    if triton is None:
        raise RuntimeError("decode_attention needs Triton; use fused_ops.rotary_kv_write + paged attention")
    tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
    n_seqs, max_blocks = block_tables.shape
    _, block_size, _, _ = k_cache.shape
    assert tokens == n_seqs and supports(head_dim, n_heads, n_kv_heads), (tokens, n_seqs, head_dim)
    assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and sin.stride(0) == cos.stride(0)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    group = n_heads // n_kv_heads
    if splits is None:
        splits = decode_splits(tokens * n_kv_heads, max_blocks * block_size)
    assert splits >= 1 and splits & (splits - 1) == 0, splits
    out = torch.empty(tokens, n_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    target, lse, out_strides = split_buffers(out, splits)
    if tokens == 0:
        return out
    use_pdl = pdl(qkv.device)
    _decode_attention_kernel[(tokens, n_kv_heads, splits)](
        qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, target, lse, block_tables, seq_lens,
        float(scale), max_blocks, qkv.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), *out_strides, block_tables.stride(0),
        HQ=n_heads, HKV=n_kv_heads, HEAD_DIM=head_dim, GROUP=group, G_PAD=max(16, 1 << (group - 1).bit_length()),
        BLOCK_N=DECODE_BLOCK_N, BLOCK_SIZE=block_size, SPLITS=splits, PDL=use_pdl,
        num_warps=4, launch_pdl=use_pdl)  # attention_gpu's: the same mma tiling (no spills up to head_dim 256)
    combine_splits(target, lse, out, use_pdl)
    return out
