"""Paged attention on the GPU: one Triton kernel for decode and prefill over the block pool, GQA-aware.

    out = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale)

The same contract as the engine's torch reference `paged_attention_reference`:
q (T, hq, d): this step's queries, sequences concatenated; k_cache / v_cache (num_blocks, block_size,
hkv, d): one layer's pool with this step's k/v already written; block_tables (S, max_blocks) int32;
seq_lens (S,) int32, tokens cached per sequence after this step; query_start (S+1,) int32: sequence i's
queries are q[query_start[i]:query_start[i+1]], its last n_i tokens, query j at position
seq_lens[i] - n_i + j attending causally to positions 0..its own. Returns (T, hq, d) in q's dtype.

How it runs: the queries are cut into tiles of BLOCK_M consecutive tokens of one sequence; one program
takes a tile and one KV head, with the hq/hkv query heads of that KV head as extra rows, so each K/V
chunk is read once for all of them (no K/V repeat). It walks the sequence's pages BLOCK_N positions at a
time (the page of each position looked up in the block table, so any block size works) with an online
softmax. Decode steps (T == S: one query per sequence) use one-token tiles and split the KV range over
several programs when the batch alone cannot fill the GPU (split-KV, then a small combine kernel).
The launch grid and the split count depend only on tensor shapes, and nothing reads device values on the
host, so a decode step can be captured in a CUDA graph. fourfold.infer.decode_attention_gpu (rotary in
front of the decode branch) shares the chunk loop `attend_chunks` (and its two halves, `load_chunk` and
`attend_chunk`), `store_split`, the split rule `decode_splits`, the partial buffers `split_buffers` and the
combine `combine_splits`.

Triton is optional: `available()` says whether it imported; CPU users use the torch reference. The
tests run the kernel on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import weakref

import torch

from fourfold.ops.triton_launch import pdl, triton

SPLIT_TARGET_PROGRAMS = 1024
"""Decode splits the KV range until about this many programs run (several per SM on an H100/H200: at 64
sequences x 4 KV heads the KV range is cut in 4)."""
MAX_SPLITS = 32
DECODE_BLOCK_N = 32
"""KV positions per chunk of a decode step's attention loop (prefill tiles use 64)."""


def available() -> bool:
    """Whether Triton imported, so `paged_attention` can run."""
    return triton is not None


KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""What the engine's Triton kernels compute in (float32 sums); a float64 model runs torch's attention instead."""


def runs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the engine's GPU kernels (this attention, the fused decoder, CUDA graphs) serve a model of `dtype`
    on `device`: CUDA, Triton, and a dtype of KERNEL_DTYPES. Otherwise the model's own forward with torch's
    attention runs (float64 on a GPU: a reference, not a fast path)."""
    return available() and device.type == "cuda" and dtype in KERNEL_DTYPES


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def decode_splits(programs: int, max_kv: int) -> int:
    """Splits of a decode step's KV range, from shapes only: `programs` (one-token tiles x KV heads) times the
    splits reaches about SPLIT_TARGET_PROGRAMS; a power of two, at most MAX_SPLITS and the next power of two
    of the chunks in `max_kv` positions (the block tables' width times the block size)."""
    wanted = -(-SPLIT_TARGET_PROGRAMS // max(1, programs))
    return min(_next_pow2(wanted), _next_pow2(-(-max_kv // DECODE_BLOCK_N)), MAX_SPLITS)


if triton is not None:
    import triton.language as tl

    from fourfold.ops.triton_launch import pdl_signal, pdl_wait

    # the block tables' width differs from step to step; a variant per width % 16 would be compiled mid-serving
    @triton.jit(do_not_specialize=["max_blocks", "stride_bt"])
    def _attend_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
                       tile_seq_ptr, tile_first_ptr, scale, max_blocks,
                       stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                       stride_ot, stride_oh, stride_os, stride_bt,
                       HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       SPLITS: tl.constexpr, PDL: tl.constexpr):
        pdl_signal(PDL)
        pdl_wait(PDL)
        tile, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        seq = tl.load(tile_seq_ptr + tile)
        first = tl.load(tile_first_ptr + tile)
        q_begin = tl.load(query_start_ptr + seq)
        n_queries = tl.load(query_start_ptr + seq + 1) - q_begin
        seq_len = tl.load(seq_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_M * G_PAD)
        token = first + rows // G_PAD
        head_in_group = rows % G_PAD
        row_valid = (token < n_queries) & (head_in_group < GROUP)
        position = seq_len - n_queries + token  # each row's own position; it sees 0..position
        head = kv_head * GROUP + head_in_group
        dims = tl.arange(0, D_PAD)
        dim_valid = dims < HEAD_DIM
        q = tl.load(q_ptr + (q_begin + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
        # KV positions this tile needs, cut into SPLITS ranges of whole BLOCK_N chunks.
        last_token = tl.minimum(first + BLOCK_M, n_queries) - 1
        kv_len = (seq_len - n_queries + last_token + 1) * (first < n_queries).to(tl.int32)  # 0: surplus tile
        chunks = tl.cdiv(kv_len, BLOCK_N)
        per_split = tl.cdiv(chunks, SPLITS)
        chunk_begin = split * per_split
        chunk_end = tl.minimum(chunks, chunk_begin + per_split)
        acc, m_i, l_i = softmax_start(BLOCK_M * G_PAD, D_PAD)
        acc, m_i, l_i = attend_chunks(q, k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh,
                                      block_tables_ptr + seq * stride_bt, chunk_begin, chunk_end, kv_len, position,
                                      scale, max_blocks, stride_kb, stride_ks, stride_vb, stride_vs, dims, dim_valid,
                                      0, 0, acc, m_i, l_i, BLOCK_N, BLOCK_SIZE, False)
        store_split(acc, m_i, l_i, out_ptr, lse_ptr, q_begin + token, head, dims, split, stride_ot, stride_oh,
                    stride_os, row_valid, dim_valid, SPLITS)

    @triton.jit
    def softmax_start(ROWS: tl.constexpr, D_PAD: tl.constexpr):
        """(acc, m_i, l_i) of an online softmax over no positions yet."""
        return (tl.zeros([ROWS, D_PAD], tl.float32), tl.full([ROWS], float("-inf"), tl.float32),
                tl.zeros([ROWS], tl.float32))

    @triton.jit
    def load_chunk(k_ptr, v_ptr, table_ptr, chunk, kv_len, max_blocks, stride_kb, stride_ks, stride_vb, stride_vs,
                   dims, dim_valid, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NEW_KV_IN_REGISTERS: tl.constexpr):
        """(k, v), each (BLOCK_N, D_PAD): KV chunk `chunk` of the pool (k_ptr / v_ptr at the KV head, table_ptr at
        the sequence's block-table row); positions at or past kv_len (NEW_KV_IN_REGISTERS: kv_len - 1) read 0."""
        kv_pos = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        page = kv_pos // BLOCK_SIZE
        block = tl.load(table_ptr + page, mask=page < max_blocks, other=0).to(tl.int64)
        slot = kv_pos % BLOCK_SIZE
        in_pool = kv_pos < kv_len
        if NEW_KV_IN_REGISTERS:
            in_pool = kv_pos < kv_len - 1
        mask = in_pool[:, None] & dim_valid[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks + dims[None, :], mask=mask,
                    other=0.0)
        v = tl.load(v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs + dims[None, :], mask=mask,
                    other=0.0)
        return k, v

    @triton.jit
    def attend_chunk(q, k, v, chunk, kv_len, position, scale, acc, m_i, l_i, k_new, v_new, BLOCK_N: tl.constexpr,
                     NEW_KV_IN_REGISTERS: tl.constexpr):
        """One online-softmax step: q's rows over chunk `chunk`'s k / v (from load_chunk), row r seeing positions
        0..position[r] below kv_len; the new (acc, m_i, l_i). NEW_KV_IN_REGISTERS: position kv_len - 1 is
        k_new / v_new (D_PAD,)."""
        kv_pos = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_valid = kv_pos < kv_len
        if NEW_KV_IN_REGISTERS:
            current = (kv_pos == kv_len - 1)[:, None]
            k = tl.where(current, k_new[None, :], k)
            v = tl.where(current, v_new[None, :], v)
        scores = tl.dot(q, tl.trans(k)) * scale
        visible = (kv_pos[None, :] <= position[:, None]) & kv_valid[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return acc, m_new, l_i

    @triton.jit
    def attend_chunks(q, k_ptr, v_ptr, table_ptr, chunk_begin, chunk_end, kv_len, position, scale, max_blocks,
                      stride_kb, stride_ks, stride_vb, stride_vs, dims, dim_valid, k_new, v_new, acc, m_i, l_i,
                      BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NEW_KV_IN_REGISTERS: tl.constexpr):
        """(acc, m_i, l_i) carried on from the given ones (softmax_start: none yet) over the KV chunks
        chunk_begin..chunk_end-1: load_chunk then attend_chunk for each."""
        for chunk in range(chunk_begin, chunk_end):
            k, v = load_chunk(k_ptr, v_ptr, table_ptr, chunk, kv_len, max_blocks, stride_kb, stride_ks, stride_vb,
                              stride_vs, dims, dim_valid, BLOCK_N, BLOCK_SIZE, NEW_KV_IN_REGISTERS)
            acc, m_i, l_i = attend_chunk(q, k, v, chunk, kv_len, position, scale, acc, m_i, l_i, k_new, v_new,
                                         BLOCK_N, NEW_KV_IN_REGISTERS)
        return acc, m_i, l_i

    @triton.jit
    def store_split(acc, m_i, l_i, out_ptr, lse_ptr, token, head, dims, split, stride_ot, stride_oh, stride_os,
                    row_valid, dim_valid, SPLITS: tl.constexpr):
        """Store the rows' normalised output: with one split the final output (out_ptr's dtype), else this
        split's float32 partial at split * stride_os and its log-sum-exp, for _combine_kernel."""
        out_rows = (token * stride_ot + head * stride_oh)[:, None] + dims[None, :]
        store_mask = row_valid[:, None] & dim_valid[None, :]
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if SPLITS == 1:
            tl.store(out_ptr + out_rows, out.to(out_ptr.dtype.element_ty), mask=store_mask)
        else:
            tl.store(out_ptr + out_rows + split * stride_os, out, mask=store_mask)
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
            lse_rows = token * (stride_ot // stride_os) + head * (stride_oh // stride_os) + split
            tl.store(lse_ptr + lse_rows, lse, mask=row_valid)

    @triton.jit
    def _combine_kernel(partial_ptr, lse_ptr, out_ptr, n_heads, stride_ot, stride_oh,
                        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
        pdl_signal(PDL)
        pdl_wait(PDL)
        # partial (T, hq, SPLITS, d): each split's softmax-normalised output; lse (T, hq, SPLITS) its weight.
        token, head = tl.program_id(0), tl.program_id(1)
        base = token * n_heads + head
        splits = tl.arange(0, SPLITS)
        dims = tl.arange(0, D_PAD)
        lse = tl.load(lse_ptr + base * SPLITS + splits)
        weight = tl.exp(lse - tl.max(lse, axis=0))  # empty splits have lse -inf and weight 0
        partial = tl.load(partial_ptr + (base * SPLITS + splits)[:, None] * HEAD_DIM + dims[None, :],
                          mask=dims[None, :] < HEAD_DIM, other=0.0)
        out = tl.sum(partial * weight[:, None], axis=0) / tl.sum(weight, axis=0)
        tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
                 mask=dims < HEAD_DIM)


_last_tiles: list = [None, None]  # [key, value]: one step's tiles, shared by all its layers


def _step_tiles(query_start: torch.Tensor, total: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`_tiles`, computed once per step: every layer of a step passes the same query_start tensor object.

    The key holds the tensor weakly with its version (an in-place change recomputes) and whether a CUDA
    graph is being captured, so a capture computes its tiles inside the graph, never from a warm-up run.
    """
    capturing = query_start.is_cuda and torch.cuda.is_current_stream_capturing()
    key = (query_start._version, total, block_m, capturing)
    ref, cached_key = (_last_tiles[0] or (None, None))
    if ref is not None and ref() is query_start and cached_key == key:
        return _last_tiles[1]
    tiles = _tiles(query_start, total, block_m)
    _last_tiles[0], _last_tiles[1] = (weakref.ref(query_start), key), tiles
    return tiles


def _tiles(query_start: torch.Tensor, total: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(sequence of each tile, its first query index in that sequence, number of tiles), without a host sync.

    The tile count is an upper bound known from shapes alone; surplus tiles get a first index past the
    sequence's queries and do nothing.
    """
    starts = query_start.long()
    if block_m == 1:
        count = total
        tokens = torch.arange(count, device=starts.device)
        seq = torch.searchsorted(starts[1:], tokens, right=True).clamp_max(starts.numel() - 2)
        return seq.int(), (tokens - starts[seq]).int(), count
    n_seqs = starts.numel() - 1
    count = -(-total // block_m) + n_seqs
    per_seq = (starts[1:] - starts[:-1] + block_m - 1) // block_m
    tile_end = per_seq.cumsum(0)
    tiles = torch.arange(count, device=starts.device)
    seq = torch.searchsorted(tile_end, tiles, right=True)
    valid = seq < n_seqs
    seq = seq.clamp_max(n_seqs - 1)
    first = (tiles - (tile_end[seq] - per_seq[seq])) * block_m
    first = torch.where(valid, first, torch.full_like(first, 1 << 30))
    return seq.int(), first.int(), count


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of this step's queries over the paged pool; see the module docstring."""
    if triton is None:
        raise RuntimeError("paged_attention needs Triton; on CPU use the engine's paged_attention_reference")
    total, n_heads, head_dim = q.shape
    _, block_size, n_kv_heads, _ = k_cache.shape
    n_seqs, max_blocks = block_tables.shape
    group = n_heads // n_kv_heads
    assert group * n_kv_heads == n_heads and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    g_pad = max(_next_pow2(group), 1)
    d_pad = max(_next_pow2(head_dim), 16)
    decode = total <= n_seqs  # every sequence has at most one query: one-token tiles
    block_m = 1 if decode else max(1, 64 // g_pad)
    g_pad = max(g_pad, 16 // block_m)  # tl.dot wants at least 16 rows
    block_n = DECODE_BLOCK_N if decode else 64
    tile_seq, tile_first, tiles = _step_tiles(query_start, total, block_m)
    splits = decode_splits(tiles * n_kv_heads, max_blocks * block_size) if decode else 1
    out = torch.empty_like(q)
    target, lse, out_strides = split_buffers(out, splits)
    if tiles == 0:
        return out
    use_pdl = pdl(q.device)
    _attend_kernel[(tiles, n_kv_heads, splits)](
        q, k_cache, v_cache, target, lse, block_tables, seq_lens, query_start, tile_seq, tile_first,
        float(scale), max_blocks,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *out_strides, block_tables.stride(0),
        HEAD_DIM=head_dim, D_PAD=d_pad, GROUP=group, G_PAD=g_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, SPLITS=splits, PDL=use_pdl, num_warps=4, launch_pdl=use_pdl)
    combine_splits(target, lse, out, use_pdl)
    return out


def split_buffers(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """(target, lse, its token / head / split strides) for the attention kernel writing `out` (T, hq, d): out
    itself for one split, else float32 partials (T, hq, splits, d) and log-sum-exps (T, hq, splits)."""
    if splits == 1:
        return out, out, (out.stride(0), out.stride(1), 0)
    total, n_heads, head_dim = out.shape
    target = torch.empty(total, n_heads, splits, head_dim, device=out.device, dtype=torch.float32)
    lse = torch.empty(total, n_heads, splits, device=out.device, dtype=torch.float32)
    return target, lse, (target.stride(0), target.stride(1), target.stride(2))


def combine_splits(target: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, use_pdl: bool) -> None:
    """out = the splits' partials in `target` (from `split_buffers`) weighted by softmax(lse): the combine
    kernel, one program per (token, head); nothing when `target` is `out` (one split)."""
    if target is out or out.shape[0] == 0:
        return
    total, n_heads, head_dim = out.shape
    _combine_kernel[(total, n_heads)](target, lse, out, n_heads, out.stride(0), out.stride(1),
                                      HEAD_DIM=head_dim, D_PAD=max(_next_pow2(head_dim), 16), SPLITS=target.shape[2],
                                      PDL=use_pdl, num_warps=1, launch_pdl=use_pdl)
