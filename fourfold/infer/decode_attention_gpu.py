"""Decode-step attention in one Triton kernel: rotary, KV-cache write, split-KV paged attention and its combine.

    out = decode_attention(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                           scale, n_heads, n_kv_heads)

For steps with exactly one query per sequence (T == S, token i of sequence i), the same result as
    q = fused_ops.rotary_kv_write(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, hq, hkv)
    out = attention_gpu.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale)
(same tensor contracts) from one launch instead of three (rotary, attention, split combine), which at
batch 1 saves two dependent launches per layer.

How it runs: the grid is (T, hkv, SPLITS). Each program loads its kv head's GROUP = hq / hkv query heads,
the new key and the new value from the q|k|v row and rotates q and k with fused_ops.rotate_rounded, so
both are bit for bit the old path's. Split 0 writes the new key and value to the pool slot, exactly as
rotary_kv_write does. Programs of other splits may run before that write lands, so no program reads the
current position (seq_len - 1) from the pool: positions 0..seq_len-2 come from the pages and the current
one from the registers (the chunk that holds it swaps the new k / v row in before its dots). Each split
walks its share of the KV range in chunks of 32 positions with an online softmax, like attention_gpu
(same chunking and split ranges). The splits that got positions (`active`, known to every program from
seq_len) finish alone when there is one of them: it writes the output. Otherwise each active program stores
its normalised partial output and log-sum-exp to a float32 scratch, fences (every thread, gpu scope), meets
the CTA barrier, and takes a ticket with an acq_rel atomic on a per-(token, kv head) counter; the program
that draws the last ticket fences again, reads the active partials (".cg": from L2, past L1), writes the
combined output of its GROUP heads and sets the counter back to 0 for the next layer or graph replay.
Splits without positions (never split 0, which writes the pool) do nothing more.
The counters live in one zeroed int32 buffer per device, allocated once (never per call: that would add
a memset kernel) and kept for good, so captured CUDA graphs keep pointing at live memory. The split count
and grid depend only on shapes (block_tables' width times the block size, the batch), never on device
values, so a step can be captured in a CUDA graph. Padded graph rows (position 0, seq_len 1, slot in the
scratch block) read nothing from the pool and write only their own scratch slot.
Two launches must not use one device's counters at the same time (the engine runs one stream).
"""

from __future__ import annotations

import os

import torch

from fourfold.ops.triton_launch import pdl, triton

SPLIT_TARGET_PROGRAMS = 512
"""The KV range is split until about this many programs run (at batch 1 with 4 KV heads the MAX_SPLITS cap
gives 128 programs)."""
MAX_SPLITS = 32
BLOCK_N = 32
"""KV positions per chunk of the attention loop."""
COUNTER_SLOTS = 4096 * 64
"""Per-(token, kv head) ticket counters allocated per device at first use (grown outside graph capture)."""


def _num_warps(head_dim: int) -> int:
    """4 warps up to head_dim 64; 8 above (at 128 and 4 warps ptxas spills: 255 registers for sm_90)."""
    return 4 if head_dim <= 64 else 8


_counters: dict = {}  # device -> zeroed int32 buffer
_retired: list = []  # smaller buffers replaced by a larger one: a captured graph may still use them


def available() -> bool:
    """Whether Triton imported, so `decode_attention` can run (on CUDA, or under TRITON_INTERPRET=1)."""
    return triton is not None


def supports(head_dim: int, n_heads: int, n_kv_heads: int) -> bool:
    """Whether the kernel handles these head shapes: a power-of-two head_dim of 16..256, hq a multiple of hkv."""
    group = n_heads // max(n_kv_heads, 1)
    return (available() and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and n_kv_heads > 0
            and group * n_kv_heads == n_heads and group <= 64)


def _pow2_at_most(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def split_count(tokens: int, n_kv_heads: int, max_kv: int) -> int:
    """Splits of the KV range from shapes only: a power of two <= MAX_SPLITS and <= the chunks of `max_kv`."""
    wanted = -(-SPLIT_TARGET_PROGRAMS // max(1, tokens * n_kv_heads))
    chunks = max(1, -(-max_kv // BLOCK_N))
    return max(1, min(_pow2_at_most(chunks), 1 << (wanted - 1).bit_length(), MAX_SPLITS))


def _counter_buffer(device: torch.device, needed: int) -> torch.Tensor | None:
    """The device's zeroed ticket counters (>= needed), or None while capturing a graph if too small."""
    key = (device.type, device.index)
    buf = _counters.get(key)
    if buf is None or buf.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _retired.append(buf)
        buf = torch.zeros(max(needed, COUNTER_SLOTS), dtype=torch.int32, device=device)
        _counters[key] = buf
    return buf


if triton is not None:
    import triton.language as tl

    from fourfold.infer.fused_ops import rotate_rounded
    from fourfold.ops.triton_launch import pdl_signal, pdl_wait

    @triton.jit
    def _fence_gpu(FENCE: tl.constexpr, THREADS: tl.constexpr):
        """fence.acq_rel.gpu in every thread (one element per thread); off under the interpreter."""
        if FENCE:
            tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.u32 $0, $1;", "=r,r", [tl.arange(0, THREADS)],
                                      dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _rotated(row_ptr, dims, partner, first_half, c, s, mask):
        """Rotary of the (rows, d) heads at row_ptr + dims, rounded like fused_ops._rotary_kv_kernel."""
        x = tl.load(row_ptr + dims, mask=mask, other=0.0)
        xp = tl.load(row_ptr + partner, mask=mask, other=0.0)
        return rotate_rounded(x, tl.where(first_half, -xp, xp), c, s)

    @triton.jit
    def _decode_attention_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr, out_ptr, part_ptr,
                                 lse_ptr, count_ptr, block_tables_ptr, seq_lens_ptr, scale, max_blocks,
                                 stride_qkv, stride_cos, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                 stride_vh, stride_bt,
                                 HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                                 G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                                 SPLITS: tl.constexpr, FENCE: tl.constexpr, THREADS: tl.constexpr,
                                 PDL: tl.constexpr):
        pdl_signal(PDL)
        pdl_wait(PDL)
        token, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + token)
        pos = tl.load(pos_ptr + token)
        dims = tl.arange(0, HEAD_DIM)
        first_half = dims < HEAD_DIM // 2
        partner = dims ^ (HEAD_DIM // 2)  # the element rotate_half pairs with
        dt = qkv_ptr.dtype.element_ty
        c = tl.load(cos_ptr + pos * stride_cos + dims).to(dt).to(tl.float32)
        s = tl.load(sin_ptr + pos * stride_cos + dims).to(dt).to(tl.float32)
        row = qkv_ptr + token * stride_qkv
        rows = tl.arange(0, G_PAD)
        row_valid = rows < GROUP
        head = kv_head * GROUP + rows
        q = _rotated(row + head[:, None] * HEAD_DIM, dims[None, :], partner[None, :], first_half[None, :],
                     c[None, :], s[None, :], row_valid[:, None])
        k_new = _rotated(row + (HQ + kv_head) * HEAD_DIM, dims, partner, first_half, c, s,
                         dims < HEAD_DIM).to(k_ptr.dtype.element_ty)
        v_new = tl.load(row + (HQ + HKV + kv_head) * HEAD_DIM + dims).to(v_ptr.dtype.element_ty)
        if split == 0:  # the pool write of rotary_kv_write; nobody in this launch reads it back
            slot = tl.load(slot_ptr + token)
            page, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            tl.store(k_ptr + page * stride_kb + offset * stride_ks + kv_head * stride_kh + dims, k_new)
            tl.store(v_ptr + page * stride_vb + offset * stride_vs + kv_head * stride_vh + dims, v_new)
        current = seq_len - 1  # this token's position: its k / v come from registers, not the pool
        chunks = tl.cdiv(seq_len, BLOCK_N)
        per_split = tl.maximum(tl.cdiv(chunks, SPLITS), 1)
        active = tl.cdiv(chunks, per_split)  # splits 0..active-1 have positions; the others only wrote the pool
        chunk_begin = split * per_split
        chunk_end = tl.minimum(chunks, chunk_begin + per_split)
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
        offsets = tl.arange(0, BLOCK_N)
        for chunk in range(chunk_begin, chunk_end):
            kv_pos = chunk * BLOCK_N + offsets
            page = kv_pos // BLOCK_SIZE
            in_pool = (kv_pos < current) & (page < max_blocks)
            block = tl.load(block_tables_ptr + token * stride_bt + page, mask=in_pool, other=0).to(tl.int64)
            slot = kv_pos % BLOCK_SIZE
            is_new = (kv_pos == current)[:, None]
            k = tl.load(k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
                        + dims[None, :], mask=in_pool[:, None], other=0.0)
            k = tl.where(is_new, k_new[None, :], k)
            scores = tl.dot(q, tl.trans(k)) * scale
            scores = tl.where((kv_pos <= current)[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
                        + dims[None, :], mask=in_pool[:, None], other=0.0)
            v = tl.where(is_new, v_new[None, :], v)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if SPLITS == 1 or active == 1:  # one split holds the whole range: its output is final
            if split == 0:
                tl.store(out_ptr + (token * HQ + head)[:, None] * HEAD_DIM + dims[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
        elif split < active:
            # partial (T, hq, SPLITS, d) and lse (T, hq, SPLITS), float32; rows of splits >= active are never read
            part_rows = (token * HQ + head) * SPLITS
            lse = m_i + tl.log(l_i)  # every active split sees at least one position
            tl.store(part_ptr + (part_rows + split)[:, None] * HEAD_DIM + dims[None, :], out, mask=row_valid[:, None])
            tl.store(lse_ptr + part_rows + split, lse, mask=row_valid)
            _fence_gpu(FENCE, THREADS)  # each thread's partial stores, ordered before ...
            tl.debug_barrier()  # ... the CTA barrier, before the ticket (release at gpu scope)
            counter = count_ptr + token * HKV + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == active - 1:  # every other active split has published its partial: combine
                _fence_gpu(FENCE, THREADS)
                _combine(part_ptr, lse_ptr, out_ptr, token * HQ + kv_head * GROUP, active, dims,
                         HEAD_DIM, GROUP, SPLITS)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next layer / replay

    @triton.jit
    def _combine(part_ptr, lse_ptr, out_ptr, first_row, active, dims, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
                 SPLITS: tl.constexpr):
        """out[row] = sum_s exp(lse_s - max) partial_s / sum_s exp(lse_s - max) over the `active` splits, for
        the GROUP heads from first_row; each head one (SPLITS, d) load from L2 (".cg"), unrolled so the loads
        of several heads are in flight together."""
        splits = tl.arange(0, SPLITS)
        used = splits < active
        for g in tl.static_range(GROUP):
            rows = (first_row + g) * SPLITS + splits
            lse = tl.load(lse_ptr + rows, mask=used, other=float("-inf"), cache_modifier=".cg")
            weight = tl.exp(lse - tl.max(lse, axis=0))
            partial = tl.load(part_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=used[:, None], other=0.0,
                              cache_modifier=".cg")
            out = tl.sum(partial * weight[:, None], axis=0) / tl.sum(weight, axis=0)
            tl.store(out_ptr + (first_row + g) * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


def decode_attention(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, n_heads: int,
                     n_kv_heads: int, splits: int | None = None) -> torch.Tensor:
    """Rotary + KV write + paged attention of a decode step (one query per sequence); see the module docstring.

    `splits` forces the split count (a power of two; tests); by default `split_count` of the shapes.
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
        splits = split_count(tokens, n_kv_heads, max_blocks * block_size)
    assert splits >= 1 and splits & (splits - 1) == 0, splits
    out = torch.empty(tokens, n_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    counters = _counter_buffer(qkv.device, tokens * n_kv_heads) if splits > 1 else None
    if counters is None:
        splits = 1
    if splits > 1:
        part = torch.empty(tokens, n_heads, splits, head_dim, device=qkv.device, dtype=torch.float32)
        lse = torch.empty(tokens, n_heads, splits, device=qkv.device, dtype=torch.float32)
    else:
        part, lse, counters = out, out, out
    if tokens == 0:
        return out
    use_pdl = pdl(qkv.device)
    warps = _num_warps(head_dim)
    fence = qkv.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
    _decode_attention_kernel[(tokens, n_kv_heads, splits)](
        qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, out, part, lse, counters, block_tables, seq_lens,
        float(scale), max_blocks, qkv.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0),
        HQ=n_heads, HKV=n_kv_heads, HEAD_DIM=head_dim, GROUP=group, G_PAD=max(16, 1 << (group - 1).bit_length()),
        BLOCK_N=BLOCK_N, BLOCK_SIZE=block_size, SPLITS=splits, FENCE=fence, THREADS=32 * warps, PDL=use_pdl,
        num_warps=warps, launch_pdl=use_pdl)
    return out
