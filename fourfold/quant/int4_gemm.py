"""Triton W4A16 GEMM for many-token steps: bf16 activations times int4 weights dequantized in registers.

    y = int4_gemm(x, weight_int4, scales, zero_points, group_size, bias)     # x (.., K) -> y (.., N)

Weights in fourfold.quant.packing's stored layout, read as they are (no repacking, no extra copy): uint8
[N, K/2] holding u = q + 8 (element 2j in the high nibble, 2j+1 in the low one), scales [N, K/G], int8 zero
points [N, K/G]; the weight is (u - 8 - z) * s. One program owns a BLOCK_M x BLOCK_N output tile and walks K
in BLOCK_K steps; BLOCK_K divides the group size, so each step needs one scale (and zero point) per output
row. A step loads the (BLOCK_N, BLOCK_K/2) packed bytes, dequantizes high and low nibbles to x's dtype,
interleaves them back into k order (tl.join + reshape: (BLOCK_N, BLOCK_K)) and does one `tl.dot` with the
(BLOCK_M, BLOCK_K) tile of x into a float32 accumulator (at 65-128 rows the dot is turned around, W x.T, so
the dequantized tile is the operand Hopper's wgmma takes from registers: W_LEFT in _config). bf16 scales and
activations dequantize without conversions (_nibble_weights: the nibble's bits OR-ed into bf16 128.0's, same
results bit for bit). K needs no edge mask (a multiple of the group size,
hence of BLOCK_K); M and N do. With SPLIT_K > 1 the K steps are shared by SPLIT_K programs per tile, each
storing float32 partial sums that a second small kernel adds up (with the bias) into the output: a 2048-row
matrix gives only 64 tiles of 32 columns, too few for 132 SMs walking K one step at a time. The grid depends
only on shapes, so the call can be captured in a CUDA graph.

Above DEQUANT_ROWS rows the weight is instead dequantized whole (one Triton kernel, a transient (N, K) copy
in x's dtype) and multiplied by cuBLAS, which was faster there. Measured on an H200 (bench/int4_gemm_check.py,
bench/results/2026-11-24-h200-int4gemm/): torch's tile-packed `_weight_int4pack_mm` (tinygemm) wins up to
~8 rows and then falls far behind (256 rows: 8-12x slower than this module), hence TINYGEMM_ROWS.
An earlier form that multiplied high / low nibbles with the even / odd columns of x (two dots, strided x
loads) was 2-10x slower than the one-dot form and was dropped.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from fourfold.ops.triton_launch import triton

TINYGEMM_ROWS = 6
"""On CUDA, steps of at most this many token rows use torch's `_weight_int4pack_mm` (Int4WeightLinear); more
use int4_gemm. H200, one llama-1b block (q|k|v + o + gate|up + down), with split-K: tinygemm 29.5 us vs 36.5
at 4 rows, 40.3 vs 36.6 at 8, 63.1 vs 37.4 at 16 (bench/results/2026-11-24-h200-int4gemm-splitk/); 5-7 rows
were not timed, 6 is the crossover by interpolation."""
DEQUANT_ROWS = 128
"""Above this many rows int4_gemm dequantizes the whole weight and calls cuBLAS (H200, llama-1b's four block
shapes summed, bench/results/2026-11-24-h200-int4gemm-wleft/: at 128 rows the fused kernel with the weight as
the dot's left operand 69.7 against 75.2 us, cuBLAS on bf16 weights 42.8; above, dequantizing wins: 82.1 against
100.8 at 256 rows, 298 against 431 at 2048, with the best tile per shape)."""

WORDS_DEQUANT_ROWS = 64
"""The same on int4_mma's words (H200, bench/int4_gemm_check.py --sweep words, llama-1b's four block shapes summed,
bench/results/2026-11-25-h200-int4-one-copy/): up to 64 rows the fused kernel is within 10% of the stored layout's
(16 rows 38.1 against 36.1 us, 64 rows 55.7 against 50.7), but at 128 rows its best tiles sum to 79.2 us against
72.7 for dequantize + cuBLAS (the stored layout's W_LEFT kernel: 67.1): with two half tiles wgmma's weight operand
is 64 rows only at BLOCK_N 128, too few programs for 132 SMs."""

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _nibble_weights(u, s, z, ASYM: tl.constexpr, out_ty: tl.constexpr, BF16_BITS: tl.constexpr):
        """Nibbles u (int32 0..15, stored as q + 8) to weights (u - 8 - z) * s in out_ty, s and z broadcast to u.

        bf16 scales into bf16 weights skip both conversions: a nibble OR-ed into 0x4300 is the bf16 128 + u, minus
        136 + z is u - 8 - z exactly (integers below 256), and one bf16 multiply rounds the exact product once, as
        the float32 path's product rounded to bf16 does, so both give the same bits. BF16_BITS is off under
        TRITON_INTERPRET, where arithmetic on a bitcast bf16 tensor gave wrong numbers (triton 3.6)."""
        if BF16_BITS and out_ty == tl.bfloat16 and s.dtype == tl.bfloat16:
            off = ((z if ASYM else tl.zeros([1, 1], tl.int32)) + 136).to(tl.bfloat16)
            return ((u | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - off) * s
        v = u - 8
        if ASYM:
            v -= z
        return (v.to(tl.float32) * s.to(tl.float32)).to(out_ty)

    @triton.jit
    def _stored_tile(p_ptr, s_ptr, z_ptr, rn64, n_ok, step, stride_pn, stride_sn, STEPS_PER_GROUP: tl.constexpr,
                     ASYM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, out_ty: tl.constexpr,
                     BF16_BITS: tl.constexpr):
        """The (BLOCK_N, BLOCK_K) weights of K step `step` from the stored layout (rows rn64, masked by n_ok)."""
        group = step // STEPS_PER_GROUP
        s = tl.load(s_ptr + rn64 * stride_sn + group, mask=n_ok, other=0.0)[:, None]
        z = tl.load(z_ptr + rn64 * stride_sn + group, mask=n_ok, other=0).to(tl.int32)[:, None] if ASYM else 0
        byte = step * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        p = tl.load(p_ptr + rn64[:, None] * stride_pn + byte[None, :], mask=n_ok[:, None], other=0x88).to(tl.int32)
        w_hi = _nibble_weights((p >> 4) & 0xF, s, z, ASYM, out_ty, BF16_BITS)
        w_lo = _nibble_weights(p & 0xF, s, z, ASYM, out_ty, BF16_BITS)
        return tl.reshape(tl.join(w_hi, w_lo), (BLOCK_N, BLOCK_K))      # byte j -> k = 2j (high), 2j + 1 (low)

    @triton.jit
    def _words_halves(w_ptr, s_ptr, z_ptr, pid_n, N, step, stride_wb, stride_sn, STEPS_PER_GROUP: tl.constexpr,
                      ASYM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, out_ty: tl.constexpr,
                      BF16_BITS: tl.constexpr):
        """K step `step` of this program's BLOCK_N rows from fourfold.quant.int4_mma's fragment-order words, as two
        (BLOCK_N / 2, BLOCK_K) tiles: rows 16 b + g and rows 16 b + 8 + g (b the program's 16-row blocks, g < 8).

        Word [b, 128 q + 16 g + 4 t + 2 jh + jl] holds in nibble rh + 2 kh + 4 kl the weight of row 16 b + 8 rh + g,
        column 64 q + 32 jh + 8 t + 4 jl + 2 kh + kl: a (row, 4-column quad) is one word's nibbles rh, rh + 2,
        rh + 4, rh + 6. One 2-D load of the words serves both halves, each unpacked with constant shifts (tl.join,
        as _stored_tile does with bytes), so Triton loads the words straight into the dot's operand layout; one
        tile with a per-row shift (rh) made it convert the tile through shared memory every step (2x slower)."""
        HALF: tl.constexpr = BLOCK_N // 2
        quad = step * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)      # 16 q + 8 jh + 2 t + jl
        col_word = (quad // 16) * 128 + (quad // 8 % 2) * 2 + (quad // 2 % 4) * 4 + quad % 2
        h = tl.arange(0, HALF)
        rows = (pid_n * BLOCK_N + (h // 8) * 16 + h % 8).to(tl.int64)  # the first half's rows; the second's + 8
        ok = rows < N                                                  # N is a multiple of 16: the same for + 8
        words = tl.load(w_ptr + ((rows // 16) * stride_wb + (rows % 8) * 16)[:, None] + col_word[None, :],
                        mask=ok[:, None], other=0)
        u0 = tl.join(tl.join(words & 0xF, (words >> 8) & 0xF), tl.join((words >> 16) & 0xF, (words >> 24) & 0xF))
        u1 = tl.join(tl.join((words >> 4) & 0xF, (words >> 12) & 0xF), tl.join((words >> 20) & 0xF, (words >> 28) & 0xF))
        group = step // STEPS_PER_GROUP
        s0 = tl.load(s_ptr + rows * stride_sn + group, mask=ok, other=0.0)[:, None]
        s1 = tl.load(s_ptr + (rows + 8) * stride_sn + group, mask=ok, other=0.0)[:, None]
        z0 = tl.load(z_ptr + rows * stride_sn + group, mask=ok, other=0).to(tl.int32)[:, None] if ASYM else 0
        z1 = tl.load(z_ptr + (rows + 8) * stride_sn + group, mask=ok, other=0).to(tl.int32)[:, None] if ASYM else 0
        w0 = _nibble_weights(tl.reshape(u0, (HALF, BLOCK_K)), s0, z0, ASYM, out_ty, BF16_BITS)   # joins: kh, then kl
        w1 = _nibble_weights(tl.reshape(u1, (HALF, BLOCK_K)), s1, z1, ASYM, out_ty, BF16_BITS)
        return w0, w1

    @triton.jit
    def _join_halves(acc0, acc1, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """(BLOCK_M, BLOCK_N) from the (BLOCK_M, BLOCK_N / 2) sums of _words_halves' two row sets, rows in order."""
        acc = tl.reshape(tl.join(acc0, acc1), (BLOCK_M, BLOCK_N // 16, 8, 2))    # m, b, g, rh
        return tl.reshape(tl.permute(acc, (0, 1, 3, 2)), (BLOCK_M, BLOCK_N))

    @triton.jit
    def _words_gemm(x_rows, kk, m_ok, p_ptr, s_ptr, z_ptr, pid_n, N, first_step, stride_pn, stride_sn,
                    STEPS: tl.constexpr, STEPS_PER_GROUP: tl.constexpr, ASYM: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, W_LEFT: tl.constexpr,
                    BF16_BITS: tl.constexpr):
        """_int4_gemm_kernel's K loop on the words: (BLOCK_M, BLOCK_N) float32 sums over STEPS steps."""
        if W_LEFT:
            acc0 = tl.zeros([BLOCK_N // 2, BLOCK_M], dtype=tl.float32)
            acc1 = tl.zeros([BLOCK_N // 2, BLOCK_M], dtype=tl.float32)
        else:
            acc0 = tl.zeros([BLOCK_M, BLOCK_N // 2], dtype=tl.float32)
            acc1 = tl.zeros([BLOCK_M, BLOCK_N // 2], dtype=tl.float32)
        for i in range(STEPS):
            step = first_step + i
            w0, w1 = _words_halves(p_ptr, s_ptr, z_ptr, pid_n, N, step, stride_pn, stride_sn, STEPS_PER_GROUP, ASYM,
                                   BLOCK_N, BLOCK_K, x_rows.dtype.element_ty, BF16_BITS)
            xv = tl.load(x_rows + step * BLOCK_K + kk[None, :], mask=m_ok[:, None], other=0.0)
            if W_LEFT:
                acc0 = tl.dot(w0, tl.trans(xv), acc0, input_precision=PRECISION)
                acc1 = tl.dot(w1, tl.trans(xv), acc1, input_precision=PRECISION)
            else:
                acc0 = tl.dot(xv, tl.trans(w0), acc0, input_precision=PRECISION)
                acc1 = tl.dot(xv, tl.trans(w1), acc1, input_precision=PRECISION)
        if W_LEFT:
            acc0 = tl.trans(acc0)
            acc1 = tl.trans(acc1)
        return _join_halves(acc0, acc1, BLOCK_M, BLOCK_N)

    @triton.jit
    def _int4_gemm_kernel(x_ptr, p_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, M, N,
                          stride_xm, stride_pn, stride_sn, stride_om,
                          K_STEPS: tl.constexpr, STEPS_PER_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                          ASYM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLIT_K: tl.constexpr, PRECISION: tl.constexpr, W_LEFT: tl.constexpr,
                          BF16_BITS: tl.constexpr, WORDS: tl.constexpr):
        """WORDS: p_ptr holds fourfold.quant.int4_mma's words (stride_pn: a 16-row block's), else stored nibbles."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)   # m fastest: programs sharing a weight tile run together
        STEPS_PER_SPLIT: tl.constexpr = K_STEPS // SPLIT_K   # split-K (SPLIT_K divides K_STEPS): this program's
        first_step = tl.program_id(2) * STEPS_PER_SPLIT      # share of the K steps
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
        kk = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rm64[:, None] * stride_xm
        if WORDS:    # two half tiles, two dots (_words_halves), their sums joined back into row order
            acc = _words_gemm(x_rows, kk, m_ok, p_ptr, s_ptr, z_ptr, pid_n, N, first_step, stride_pn, stride_sn,
                              STEPS_PER_SPLIT, STEPS_PER_GROUP, ASYM, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, W_LEFT,
                              BF16_BITS)
        else:
            if W_LEFT:   # out.T = W x.T: the dequantized tile is the dot's register operand (Hopper's wgmma takes
                acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)   # it there; as the right one it goes through
            else:        # shared memory every step)
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for i in range(STEPS_PER_SPLIT):
                step = first_step + i
                w = _stored_tile(p_ptr, s_ptr, z_ptr, rn64, n_ok, step, stride_pn, stride_sn, STEPS_PER_GROUP, ASYM,
                                 BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty, BF16_BITS)
                xv = tl.load(x_rows + step * BLOCK_K + kk[None, :], mask=m_ok[:, None], other=0.0)
                if W_LEFT:
                    acc = tl.dot(w, tl.trans(xv), acc, input_precision=PRECISION)
                else:
                    acc = tl.dot(xv, tl.trans(w), acc, input_precision=PRECISION)   # PRECISION: float32 x only
            if W_LEFT:
                acc = tl.trans(acc)
        if SPLIT_K > 1:  # float32 partial sums, (SPLIT_K, M, N); _split_sum_kernel adds them up
            part = part_ptr + tl.program_id(2).to(tl.int64) * M * N + rm64[:, None] * N + rn64[None, :]
            tl.store(part, acc, mask=m_ok[:, None] & n_ok[None, :])
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            out = out_ptr + rm64[:, None] * stride_om + rn64[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _split_sum_kernel(part_ptr, b_ptr, out_ptr, M, N, stride_om, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr):
        """out (M, N) = the SPLIT_K float32 partial sums added (in split order) + bias, in out's dtype."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):
            acc += tl.load(part_ptr + (split * M + row).to(tl.int64) * N + cols, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row.to(tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _dequant_kernel(p_ptr, s_ptr, z_ptr, w_ptr, N, K, stride_pn, stride_sn, G: tl.constexpr,
                        ASYM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BF16_BITS: tl.constexpr,
                        WORDS: tl.constexpr):
        """w (N, K) in w's dtype = (u - 8 - z) * s, one (BLOCK_N, BLOCK_K) tile per program (BLOCK_K divides G);
        WORDS as in _int4_gemm_kernel."""
        pid_n, step = tl.program_id(0), tl.program_id(1)
        kk = step * BLOCK_K + tl.arange(0, BLOCK_K)
        if WORDS:    # each half tile to its rows
            w0, w1 = _words_halves(p_ptr, s_ptr, z_ptr, pid_n, N, step, stride_pn, stride_sn, G // BLOCK_K, ASYM,
                                   BLOCK_N, BLOCK_K, w_ptr.dtype.element_ty, BF16_BITS)
            h = tl.arange(0, BLOCK_N // 2)
            rows = (pid_n * BLOCK_N + (h // 8) * 16 + h % 8).to(tl.int64)
            tl.store(w_ptr + rows[:, None] * K + kk[None, :], w0, mask=(rows < N)[:, None])
            tl.store(w_ptr + (rows + 8)[:, None] * K + kk[None, :], w1, mask=(rows < N)[:, None])
        else:
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = rn < N
            rn64 = rn.to(tl.int64)
            w = _stored_tile(p_ptr, s_ptr, z_ptr, rn64, n_ok, step, stride_pn, stride_sn, G // BLOCK_K, ASYM,
                             BLOCK_N, BLOCK_K, w_ptr.dtype.element_ty, BF16_BITS)
            tl.store(w_ptr + rn64[:, None] * K + kk[None, :], w, mask=n_ok[:, None])


def available() -> bool:
    """Whether Triton imported, so `int4_gemm` can run (on CUDA tensors, or under TRITON_INTERPRET=1)."""
    return triton is not None


def _k_split(tiles: int, k_steps: int) -> int:
    """SPLIT_K: double it (up to 8) while the grid stays under about 400 programs and it divides the K steps."""
    split = 1
    while split < 8 and tiles * split * 2 <= 400 and k_steps % (split * 2) == 0:
        split *= 2
    return split


def _config(m: int, n: int, k: int, group_size: int, words: bool = False) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K, W_LEFT) by row count, from
    bench/int4_gemm_check.py's sweeps on an H200. Up to 64 rows (llama-1b at 64 rows: q|k|v 9.3 us, o 8.0, gate|up
    19.4, down 13.7; at 16: 6.9, 6.2, 13.5, 10.4; without split-K 11.7, 11.5, 22.0, 29.4 at 64): 32-column tiles,
    and K split until the grid has about 400 programs (the 2048-row matrices alone give 64). 65-128 rows: 64 x 64
    tiles with the weight as the dot's left operand, which Hopper's wgmma reads from registers (as the right one
    it is written to shared memory every step), K split the same way (at 128 rows q|k|v 12.0, o 9.9, gate|up
    26.8, down 17.9 us). Above (the fused kernel only when asked: DEQUANT_ROWS): 128 x 128 tiles, BLOCK_N
    shrinking until about one program per SM. `words` (int4_mma's layout, two half tiles a program): BLOCK_N
    doubled up to 64 rows, 128 at 65-128 (used only when asked: WORDS_DEQUANT_ROWS)."""
    bk = min(128, group_size)
    if m <= 64:
        bm, bn = (16 if m <= 16 else 64), (32 if n <= 16384 else 64)   # 64 for a vocabulary-sized head
        bn *= 2 if words else 1      # on the words each dot takes half: 16 columns would idle half the warps
        return bm, bn, bk, 4, 3, _k_split(triton.cdiv(m, bm) * triton.cdiv(n, bn), k // bk), 0
    if m <= 128:   # on the words each dot takes half the rows: 128 keeps them at wgmma's 64
        bn = 128 if words else 64
        return 64, bn, bk, 4, 3, _k_split(triton.cdiv(m, 64) * triton.cdiv(n, bn), k // bk), 1
    bm, bn = 128, 128
    while bn > 32 and triton.cdiv(m, bm) * triton.cdiv(n, bn) < 132:
        bn //= 2
    return bm, bn, bk, 8, 3, 1, 0


def dequantize_int4(weight_int4: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, group_size: int,
                    dtype: torch.dtype, asym: bool = True, words: bool = False) -> torch.Tensor:
    """The (N, K) weight (u - 8 - z) * s in `dtype` from the stored nibbles (one Triton kernel); `words`: from
    fourfold.quant.int4_mma's words instead (groups of 64 or more)."""
    n, k = scales.shape[0], scales.shape[1] * group_size
    _check_weight(weight_int4, scales, zero_points, n, k, group_size, words)
    bn, bk = 64, min(128, group_size)
    w = torch.empty(n, k, device=weight_int4.device, dtype=dtype)
    _dequant_kernel[(triton.cdiv(n, bn), k // bk)](weight_int4, scales, zero_points, w, n, k, weight_int4.stride(0),
                                                   scales.stride(0), G=group_size, ASYM=asym, BLOCK_N=bn, BLOCK_K=bk,
                                                   BF16_BITS=_bf16_bits(weight_int4), WORDS=words)
    return w


def _check_weight(weight: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, n: int, k: int,
                  group_size: int, words: bool) -> None:
    """The weight's shape for its layout (stored nibbles [N, K/2], or int4_mma's words [N/16, K/64 * 128] for
    groups of 64 or more) and the strides the kernels assume."""
    if words:
        assert group_size % 64 == 0, f"int4_gemm on int4_mma's words needs groups of 64 or more, got {group_size}"
        assert weight.shape == (n // 16, k // 64 * 128) and n % 16 == 0, (tuple(weight.shape), n, k)
    else:
        assert weight.shape == (n, k // 2), (tuple(weight.shape), n, k)
    assert k % group_size == 0 and scales.shape == zero_points.shape == (n, k // group_size)
    assert scales.stride() == zero_points.stride() and weight.stride(-1) == 1 and scales.stride(-1) == 1


def _bf16_bits(t: torch.Tensor) -> bool:
    """Whether _nibble_weights may build bf16 weights from bits (on a GPU; not under TRITON_INTERPRET)."""
    return t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for x of `dtype`: float32 as torch's own float32 matmuls (full float32 at torch's
    default "highest" precision, TF32 once torch.set_float32_matmul_precision allows it); bf16/fp16 ignore it."""
    return "ieee" if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest" else "tf32"


def int4_gemm(x: torch.Tensor, weight_int4: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor,
              group_size: int, bias: torch.Tensor | None = None, asym: bool = True,
              config: tuple[int, ...] | None = None, method: str | None = None, words: bool = False) -> torch.Tensor:
    """x (.., K) @ dequant(W).T + bias in x's dtype. `asym=False` skips the zero points (symmetric schemes);
    `config` = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K[, W_LEFT]]) overrides the choice by
    row count (W_LEFT 1: the weight tile is the dot's left operand);
    `method`: "fused" (the GEMM kernel) or "dequant" (whole weight, then cuBLAS); default by rows (DEQUANT_ROWS);
    `words`: `weight_int4` is fourfold.quant.int4_mma's fragment-order words (the decode GEMV's copy, so a module
    needs no other): groups of 64 or more, BLOCK_N a multiple of 16 and BLOCK_K of 64."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], scales.shape[0]
    _check_weight(weight_int4, scales, zero_points, n, k, group_size, words)
    if (method or ("dequant" if m > (WORDS_DEQUANT_ROWS if words else DEQUANT_ROWS) else "fused")) == "dequant":
        w = dequantize_int4(weight_int4, scales, zero_points, group_size, x.dtype, asym, words)
        return F.linear(x2, w, None if bias is None else bias.to(x.dtype)).reshape(*x.shape[:-1], n)
    bm, bn, bk, warps, stages, *rest = config or _config(m, n, k, group_size, words)
    split = max(d for d in range(1, (rest[0] if rest else 1) + 1) if (k // bk) % d == 0)  # divides the K steps
    w_left = bool(rest[1]) if len(rest) > 1 else False
    assert group_size % bk == 0 and bk % 32 == 0, f"BLOCK_K {bk} must divide the group size {group_size}"
    assert not words or (bk % 64 == 0 and bn % 16 == 0), f"tiles on int4_mma's words: BLOCK_K {bk}, BLOCK_N {bn}"
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    part = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else out
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    bias_arg = bias if bias is not None else scales
    _int4_gemm_kernel[grid](x2, weight_int4, scales, zero_points, bias_arg, out, part, m, n,
                            x2.stride(0), weight_int4.stride(0), scales.stride(0), out.stride(0),
                            K_STEPS=k // bk, STEPS_PER_GROUP=group_size // bk, HAS_BIAS=bias is not None,
                            ASYM=asym, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                            PRECISION=dot_precision(x.dtype), W_LEFT=w_left, BF16_BITS=_bf16_bits(x),
                            WORDS=words, num_warps=warps, num_stages=stages)
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _split_sum_kernel[(m, triton.cdiv(n, block))](part, bias_arg, out, m, n, out.stride(0), SPLIT_K=split,
                                                      HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out.reshape(*x.shape[:-1], n)
