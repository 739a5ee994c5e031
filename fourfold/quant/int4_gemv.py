"""Triton int4 weight-only GEMV for few-token (decode) steps, over weights repacked once into "group planes".

    words = repack_planes(weight_int4, group_size)           # once per weight (Int4WeightLinear caches it)
    y = int4_gemv(x, weight_int4, scales, zero_points, group_size, bias, words=words)   # x (M, K), M small
    act = int4_gemv(x, ..., gated=True)           # silu(x @ gate.T) * (x @ up.T), rows stacked [gate | up]
    h = int4_gemv(x, ..., residual=r)             # r + x @ W.T, rounded as the eager residual add rounds
    y = int4_gemv(h, ..., norm_weight=w, eps=e)   # (RMSNorm(h) * w) @ W.T: the norm fused in

Stored layout (fourfold.quant.packing): uint8 [N, K/2] of u = q + 8, element 2j in the high nibble; scales
[N, K/G]; int8 zero points [N, K/G]; the weight is (u - 8 - z) * s. `repack_planes` rewrites the same bytes
as int32 words [N, K/8] where word c of group t holds, in nibble i (bits 4i..4i+3), element t*G + i*G/8 + c:
all eight nibbles of a word share one group (one scale per word), and nibble plane i of consecutive words
meets a contiguous slice of x. A nibble becomes a float with two integer ops and no conversion: shifted to
bits 19..22 and OR-ed with the bits of 1.0 it reads 1 + u/16, so per group
    sum_k (u_k - 8 - z) x_k = 16 * (sum_k (1 + u_k/16) x_k - (24 + z)/16 * sum_k x_k),
and the inner loop is shift, and-or (one LOP3), FMA per weight; scale and zero point apply once per (row,
quad) after the four words of a quad (one 16-byte load, one thread, one group) are summed, so no partial sum
crosses threads before the final one. x is loaded as one vector per plane and broadcast over the program's
rows: each thread converts an x element once for all the rows it holds (bench/decode_floor.py showed the GEMVs
instruction-bound, not memory-bound). One program owns BLOCK_N rows and one token row and walks K in
KC-element chunks with 16-byte loads of packed words (the next chunk's weights and scales are loaded before
this chunk's math, the first before waiting on the previous kernel: programmatic dependent launch on Hopper,
fourfold.ops.triton_launch). H200, llama-1b at one row (bench/gemv_check.py): 1.1-1.4x torch's int4 mm.
Token rows of one weight tile are adjacent in the grid (the tile comes from HBM once, then from L2). The grid
depends only on shapes, so calls can be captured in CUDA graphs. With `residual` (epilogue) and `norm_weight`
a quantized decoder layer needs no separate add+RMSNorm kernels (fourfold.infer.fused_decoder's
INT4_FUSED_NORMS). The norm costs no extra pass: since RMSNorm(h) * w = rstd * (h * w) with one rstd per token
row, the loop multiplies each x element by its norm weight and adds up the squares of x as it goes, and rstd
scales the finished sums (before bias and SiLU). The normed row is not rounded to x's dtype first, as the
separate kernel's store rounds it, so results differ from that path by about the dtype's rounding.
"""

from __future__ import annotations

import os

import torch

from fourfold.ops.triton_launch import pdl, triton

MAX_ROWS = 1
"""Up to this many token rows (on CUDA) use this kernel; more use torch's `_weight_int4pack_mm` (up to
int4_gemm.TINYGEMM_ROWS) or fourfold.quant.int4_gemm. H200 (bench/gemv_check.py): at 2 rows torch's kernel
is faster on a llama-1b layer's four shapes together (each row is its own program here)."""

USE_ASM = True
"""On CUDA, the nibble's mask-and-OR is one inline-PTX lop3 (the interpreter runs the plain Triton ops)."""

if triton is not None:
    import triton.language as tl

    from fourfold.ops.triton_launch import pdl_signal, pdl_wait, swiglu_rounded

    @triton.jit
    def _nibble(p, i: tl.constexpr, ASM: tl.constexpr):
        """Nibble i (bits 4i..4i+3) of int32 words p as the float 1 + u/16, exactly: shift to bits 19..22, OR 1.0.
        ASM: the mask and the OR as one lop3 (ptxas emits two LOP3s for `(b & m) | c` with two immediates)."""
        if i <= 4:
            bits = p << (19 - 4 * i)
        else:
            bits = p >> (4 * i - 19)
        if ASM:
            return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x780000, 0x3F800000, 0xea;", "=r,r", [bits],
                                             dtype=tl.float32, is_pure=True, pack=1)
        return ((bits & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)

    @triton.jit
    def _load_scales(s_ptr, z_ptr, sz, s_ok, ASYM: tl.constexpr):
        """(s, c) per (row, group): the scale and (24 + z)/16, the 1.0 parts, the offset 8 and the zero point."""
        s = tl.load(s_ptr + sz, mask=s_ok, other=0.0).to(tl.float32)
        if ASYM:
            c = (tl.load(z_ptr + sz, mask=s_ok, other=0).to(tl.float32) + 24.0) * 0.0625
        else:
            c = tl.full(s.shape, 1.5, tl.float32)
        return s, c

    @triton.jit
    def _quad_terms(dot, s, c, xs_q, BLOCK_N: tl.constexpr, W: tl.constexpr):
        """Per (row, quad of words) of a chunk: s * (sum_k (1 + u/16) x - c * sum_k x) from the per-word sums; a
        quad is the four words of one 16-byte load, held by one thread and inside one group, so no shuffles."""
        dot_q = tl.sum(tl.reshape(dot, (BLOCK_N, W // 4, 4)), axis=2)
        return s * (dot_q - c * xs_q)

    @triton.jit
    def _int4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, r_ptr, nw_ptr, out_ptr, N,
                          stride_xm, stride_wn, stride_sn, stride_rm, stride_om, up_offset, eps,
                          K: tl.constexpr, G: tl.constexpr, KC: tl.constexpr, HAS_BIAS: tl.constexpr,
                          HAS_RES: tl.constexpr, GATED: tl.constexpr, ASYM: tl.constexpr, NORM: tl.constexpr,
                          BLOCK_N: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr):
        pdl_signal(PDL)
        m, pid_n = tl.program_id(0), tl.program_id(1)
        W: tl.constexpr = KC // 8          # packed words per row per chunk
        GW: tl.constexpr = G // 8          # words per group
        ITERS: tl.constexpr = (K + KC - 1) // KC
        EVEN: tl.constexpr = K % KC == 0   # else the last chunk is cut at K (whole groups: G divides K)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        rows64 = rows.to(tl.int64)
        w = tl.arange(0, W)
        quad = tl.arange(0, W // 4)
        quad_group = quad * 4 // GW        # the group of each quad's words within the chunk
        w_rows = w_ptr + rows64[:, None] * stride_wn + w[None, :]
        u_rows = w_rows + up_offset * stride_wn
        # the weights do not depend on the previous kernel: the first chunk is in flight before waiting for it
        p_ok = row_ok[:, None] & (w < K // 8)[None, :]
        p = tl.load(w_rows, mask=p_ok, other=0)
        if GATED:
            pu = tl.load(u_rows, mask=p_ok, other=0)
        sz = rows64[:, None] * stride_sn + quad_group[None, :]
        s_ok = row_ok[:, None] & (quad * 4 < K // 8)[None, :]
        s, c = _load_scales(s_ptr, z_ptr, sz, s_ok, ASYM)
        if GATED:
            su, cu = _load_scales(s_ptr, z_ptr, sz + up_offset * stride_sn, s_ok, ASYM)
        pdl_wait(PDL)
        acc = tl.zeros([BLOCK_N, W // 4], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, W // 4], dtype=tl.float32)
        x_row = x_ptr + m * stride_xm
        sq = tl.zeros([W], dtype=tl.float32)  # NORM: squares of x
        for it in range(ITERS):
            next_ok = row_ok[:, None] & ((it + 1) * W + w < K // 8)[None, :]
            p_next = tl.load(w_rows + (it + 1) * W, mask=next_ok, other=0)
            if GATED:
                pu_next = tl.load(u_rows + (it + 1) * W, mask=next_ok, other=0)
            # x slice of nibble plane i for every word (group of the word, plane offset, word within group): one
            # vector per plane, broadcast over the tile's rows, so a thread converts each x once for all its rows
            x_off = tl.max_contiguous(tl.multiple_of(it * KC + (w // GW) * G + (w % GW), 4), 4)
            w_ok = it * W + w < K // 8
            xs = tl.zeros([W], dtype=tl.float32)          # sum of x over each word's 8 elements
            dot = tl.zeros([BLOCK_N, W], dtype=tl.float32)
            dot_up = tl.zeros([BLOCK_N, W], dtype=tl.float32)
            for i in tl.static_range(8):
                if EVEN:
                    xi = tl.load(x_row + x_off + i * GW).to(tl.float32)
                else:
                    xi = tl.load(x_row + x_off + i * GW, mask=w_ok, other=0.0).to(tl.float32)
                if NORM:   # x * norm weight now, times the row's rstd once the sums are done
                    if EVEN:
                        nwi = tl.load(nw_ptr + x_off + i * GW).to(tl.float32)
                    else:
                        nwi = tl.load(nw_ptr + x_off + i * GW, mask=w_ok, other=0.0).to(tl.float32)
                    sq += xi * xi
                    xi = xi * nwi
                xs += xi
                dot += _nibble(p, i, ASM) * xi[None, :]
                if GATED:
                    dot_up += _nibble(pu, i, ASM) * xi[None, :]
            # scale and zero point once per (row, quad): each quad's words summed first
            xs_q = tl.sum(tl.reshape(xs, (W // 4, 4)), axis=1)[None, :]
            acc += _quad_terms(dot, s, c, xs_q, BLOCK_N, W)
            sz_next = sz + (it + 1) * (KC // G)
            s_ok_next = row_ok[:, None] & ((it + 1) * W + quad * 4 < K // 8)[None, :]
            s, c = _load_scales(s_ptr, z_ptr, sz_next, s_ok_next, ASYM)
            if GATED:
                acc_up += _quad_terms(dot_up, su, cu, xs_q, BLOCK_N, W)
                su, cu = _load_scales(s_ptr, z_ptr, sz_next + up_offset * stride_sn, s_ok_next, ASYM)
                pu = pu_next
            p = p_next
        y = tl.sum(acc, axis=1) * 16.0
        if NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)
            y = y * rstd
        out_ty = out_ptr.dtype.element_ty
        if HAS_BIAS:
            y = y + tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if GATED:
            up = tl.sum(acc_up, axis=1) * 16.0
            if NORM:
                up = up * rstd
            if HAS_BIAS:
                up = up + tl.load(b_ptr + up_offset + rows, mask=row_ok, other=0.0).to(tl.float32)
            y = swiglu_rounded(y, up, out_ptr)
        if HAS_RES:  # the matmul output rounded, then added in float32 and rounded (fused_ops.add_rms_norm's add)
            res = tl.load(r_ptr + m * stride_rm + rows, mask=row_ok, other=0.0).to(tl.float32)
            y = y.to(out_ty).to(tl.float32) + res
        y = y.to(out_ty)
        tl.store(out_ptr + m * stride_om + rows, y, mask=row_ok)


def available() -> bool:
    """Whether Triton imported, so `int4_gemv` can run (on CUDA tensors, or under TRITON_INTERPRET=1)."""
    return triton is not None


def repack_planes(weight_int4: torch.Tensor, group_size: int) -> torch.Tensor:
    """The stored uint8 [N, K/2] nibbles as int32 words [N, K/8] in group-plane order (module docstring)."""
    n, k = weight_int4.shape[0], weight_int4.shape[1] * 2
    if k % group_size or group_size % 8:
        raise ValueError(f"group size {group_size} must be a multiple of 8 dividing in_features {k}")
    p = weight_int4.to(torch.int64)
    u = torch.stack([p >> 4, p & 0xF], dim=-1).reshape(n, k // group_size, 8, group_size // 8)
    shifts = (4 * torch.arange(8, device=u.device)).view(1, 1, 8, 1)
    words = (u << shifts).sum(dim=2)                                          # [N, K/G, G/8], 0 .. 2^32 - 1
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)             # as two's-complement int32
    return words.reshape(n, k // 8).to(torch.int32).contiguous()


def unpack_planes(words: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of repack_planes' reordering: uint8 [N, K] of values 0..15 in k order."""
    n, k = words.shape[0], words.shape[1] * 8
    w = words.to(torch.int64).reshape(n, k // group_size, 1, group_size // 8)
    shifts = (4 * torch.arange(8, device=w.device)).view(1, 1, 8, 1)
    return ((w >> shifts) & 0xF).reshape(n, k).to(torch.uint8)


def _config(n: int, k: int, group_size: int) -> tuple[int, int, int]:
    """(BLOCK_N, KC elements per chunk, num_warps) at one row, from bench/int4_gemv_check.py's sweep on an H200
    (llama-1b: q|k|v 8 x 2048 / 2 warps 3.4 us, o the same 2.9 us, gate|up 4 x 1024 / 1 warp 5.9 us, down
    8 x 8192 / 8 warps 4.3 us). Long rows (down) take K in one chunk, so all of a program's weights are in
    flight before it waits for the previous kernel; small programs suit the rest. A chunk past K is cut at K."""
    if k > 4096:
        block_n, kc, warps = 8, min(16384, triton.next_power_of_2(k)), 8
    elif n >= 4096:
        block_n, kc, warps = 4, 1024, 1
    else:
        block_n, kc, warps = 8, 2048, 2
    return block_n, max(group_size, min(kc, triton.next_power_of_2(k))), warps


def int4_gemv(x: torch.Tensor, weight_int4: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor,
              group_size: int, bias: torch.Tensor | None = None, gated: bool = False,
              config: tuple[int, int, int] | None = None, asym: bool = True, words: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
              eps: float = 1e-5) -> torch.Tensor:
    """x (.., K) @ dequant(W).T + bias in x's dtype; `gated`: silu(first half) * second half of the rows;
    `residual` (.., N): added to the result; `norm_weight` (K,): x is first RMS-normalised (eps) and scaled
    by it (as fourfold.infer.fused_ops.add_rms_norm, without rounding the normed row: module docstring).
    `words`: repack_planes(weight_int4) if already made (else made here). `asym=False` skips the zero points
    (all zero: symmetric schemes)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if words is None:
        words = repack_planes(weight_int4, group_size)
    rows, n_total = x2.shape[0], words.shape[0]
    n = n_total // 2 if gated else n_total
    assert words.shape[1] * 8 == k and k % group_size == 0 and scales.shape == zero_points.shape
    assert scales.stride() == zero_points.stride() and words.stride(-1) == 1
    block_n, kc, warps = config or _config(n, k, group_size)
    assert kc % group_size == 0, f"chunk {kc} must be a multiple of the group size {group_size}"
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    res = None
    if residual is not None:
        res = residual.reshape(rows, n)
        assert res.stride(-1) == 1
    grid = (rows, triton.cdiv(n, block_n))
    _int4_gemv_kernel[grid](x2, words, scales, zero_points, bias if bias is not None else scales,
                            res if res is not None else out, norm_weight if norm_weight is not None else x2, out, n,
                            x2.stride(0), words.stride(0), scales.stride(0), res.stride(0) if res is not None else 0,
                            out.stride(0), n, eps, K=k, G=group_size, KC=kc, HAS_BIAS=bias is not None,
                            HAS_RES=res is not None, GATED=gated, ASYM=asym, NORM=norm_weight is not None,
                            BLOCK_N=block_n,
                            ASM=USE_ASM and x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1",
                            PDL=pdl(x.device), num_warps=warps, launch_pdl=pdl(x.device))
    return out.reshape(*x.shape[:-1], n)
