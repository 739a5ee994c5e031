"""Triton W4A16 GEMM for many-token steps: bf16 activations times int4 weights dequantized in registers.

    y = int4_gemm(x, weight_int4, scales, zero_points, group_size, bias)     # x (.., K) -> y (.., N)

Weights in fourfold.quant.packing's stored layout, read as they are (no repacking, no extra copy): uint8
[N, K/2] holding u = q + 8 (element 2j in the high nibble, 2j+1 in the low one), scales [N, K/G], int8 zero
points [N, K/G]; the weight is (u - 8 - z) * s. One program owns a BLOCK_M x BLOCK_N output tile and walks K
in BLOCK_K steps; BLOCK_K divides the group size, so each step needs one scale (and zero point) per output
row. A step loads the (BLOCK_N, BLOCK_K/2) packed bytes, dequantizes high and low nibbles to x's dtype,
interleaves them back into k order (tl.join + reshape: (BLOCK_N, BLOCK_K)) and does one `tl.dot` with the
(BLOCK_M, BLOCK_K) tile of x into a float32 accumulator. K needs no edge mask (a multiple of the group size,
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

import torch
import torch.nn.functional as F

from fourfold.ops.triton_launch import triton

TINYGEMM_ROWS = 6
"""On CUDA, steps of at most this many token rows use torch's `_weight_int4pack_mm` (Int4WeightLinear); more
use int4_gemm. H200, one llama-1b block (q|k|v + o + gate|up + down), with split-K: tinygemm 29.5 us vs 36.5
at 4 rows, 40.3 vs 36.6 at 8, 63.1 vs 37.4 at 16 (bench/results/2026-11-24-h200-int4gemm-splitk/); 5-7 rows
were not timed, 6 is the crossover by interpolation."""
DEQUANT_ROWS = 64
"""Above this many rows int4_gemm dequantizes the whole weight and calls cuBLAS (H200, the five llama-1b shapes
summed: fused 115 vs 161 us at 64 rows, 252 vs 181 us at 256 rows)."""

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _dequant_tile(p, s, z, ASYM: tl.constexpr, out_ty: tl.constexpr):
        """Packed bytes p (int32, (rows, bytes)) to weights (u - 8 - z) * s in out_ty: the (high, low) nibble tiles."""
        hi = (p >> 4) - 8
        lo = (p & 0xF) - 8
        if ASYM:
            hi -= z
            lo -= z
        w_hi = (hi.to(tl.float32) * s).to(out_ty)
        w_lo = (lo.to(tl.float32) * s).to(out_ty)
        return w_hi, w_lo

    @triton.jit
    def _int4_gemm_kernel(x_ptr, p_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, M, N,
                          stride_xm, stride_pn, stride_sn, stride_om,
                          K_STEPS: tl.constexpr, STEPS_PER_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                          ASYM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLIT_K: tl.constexpr, PRECISION: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)   # m fastest: programs sharing a weight tile run together
        STEPS_PER_SPLIT: tl.constexpr = K_STEPS // SPLIT_K   # split-K (SPLIT_K divides K_STEPS): this program's
        first_step = tl.program_id(2) * STEPS_PER_SPLIT      # share of the K steps
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
        j = tl.arange(0, BLOCK_K // 2)
        kk = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rm64[:, None] * stride_xm
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for i in range(STEPS_PER_SPLIT):
            step = first_step + i
            group = step // STEPS_PER_GROUP
            s = tl.load(s_ptr + rn64 * stride_sn + group, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            z = tl.load(z_ptr + rn64 * stride_sn + group, mask=n_ok, other=0).to(tl.int32)[:, None] if ASYM else 0
            byte = step * (BLOCK_K // 2) + j
            p = tl.load(p_ptr + rn64[:, None] * stride_pn + byte[None, :], mask=n_ok[:, None], other=0x88)
            w_hi, w_lo = _dequant_tile(p.to(tl.int32), s, z, ASYM, x_ptr.dtype.element_ty)
            w = tl.reshape(tl.join(w_hi, w_lo), (BLOCK_N, BLOCK_K))      # byte j -> k = 2j (high), 2j + 1 (low)
            xv = tl.load(x_rows + step * BLOCK_K + kk[None, :], mask=m_ok[:, None], other=0.0)
            acc = tl.dot(xv, tl.trans(w), acc, input_precision=PRECISION)   # PRECISION: float32 x only
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
                        ASYM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """w (N, K) in w's dtype = (u - 8 - z) * s, one (BLOCK_N, BLOCK_K) tile per program (BLOCK_K divides G)."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        step = tl.program_id(1)
        n_ok = rn < N
        rn64 = rn.to(tl.int64)
        byte = step * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        group = (step * BLOCK_K) // G
        s = tl.load(s_ptr + rn64 * stride_sn + group, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        z = tl.load(z_ptr + rn64 * stride_sn + group, mask=n_ok, other=0).to(tl.int32)[:, None] if ASYM else 0
        p = tl.load(p_ptr + rn64[:, None] * stride_pn + byte[None, :], mask=n_ok[:, None], other=0x88)
        w_hi, w_lo = _dequant_tile(p.to(tl.int32), s, z, ASYM, w_ptr.dtype.element_ty)
        w = tl.reshape(tl.join(w_hi, w_lo), (BLOCK_N, BLOCK_K))
        kk = step * BLOCK_K + tl.arange(0, BLOCK_K)
        tl.store(w_ptr + rn64[:, None] * K + kk[None, :], w, mask=n_ok[:, None])


def available() -> bool:
    """Whether Triton imported, so `int4_gemm` can run (on CUDA tensors, or under TRITON_INTERPRET=1)."""
    return triton is not None


def _config(m: int, n: int, k: int, group_size: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) by row count, from bench/int4_gemm_check.py's
    sweep on an H200 (llama-1b at 64 rows: q|k|v 9.3 us, o 8.0, gate|up 19.4, down 13.7; at 16: 6.9, 6.2, 13.5,
    10.4; without split-K 11.7, 11.5, 22.0, 29.4 at 64). Up to 64 rows: 32-column tiles, and K split until the
    grid has about 400 programs (the 2048-row matrices alone give 64), at most 8 ways. Above 64 rows (the
    fused kernel only when asked: DEQUANT_ROWS): 128 x 128 tiles, BLOCK_N shrinking until about one program
    per SM."""
    bk = min(128, group_size)
    if m <= 64:
        bm, bn = (16 if m <= 16 else 64), (32 if n <= 16384 else 64)   # 64 for a vocabulary-sized head
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        split = 1
        while split < 8 and tiles * split * 2 <= 400 and (k // bk) % (split * 2) == 0:
            split *= 2
        return bm, bn, bk, 4, 3, split
    bm, bn = 128, 128
    while bn > 32 and triton.cdiv(m, bm) * triton.cdiv(n, bn) < 132:
        bn //= 2
    return bm, bn, bk, 8, 3, 1


def dequantize_int4(weight_int4: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, group_size: int,
                    dtype: torch.dtype, asym: bool = True) -> torch.Tensor:
    """The (N, K) weight (u - 8 - z) * s in `dtype` from the stored nibbles (one Triton kernel)."""
    n, k = weight_int4.shape[0], weight_int4.shape[1] * 2
    bn, bk = 64, min(128, group_size)
    w = torch.empty(n, k, device=weight_int4.device, dtype=dtype)
    _dequant_kernel[(triton.cdiv(n, bn), k // bk)](weight_int4, scales, zero_points, w, n, k, weight_int4.stride(0),
                                                   scales.stride(0), G=group_size, ASYM=asym, BLOCK_N=bn, BLOCK_K=bk)
    return w


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for x of `dtype`: float32 as torch's own float32 matmuls (full float32 at torch's
    default "highest" precision, TF32 once torch.set_float32_matmul_precision allows it); bf16/fp16 ignore it."""
    return "ieee" if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest" else "tf32"


def int4_gemm(x: torch.Tensor, weight_int4: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor,
              group_size: int, bias: torch.Tensor | None = None, asym: bool = True,
              config: tuple[int, ...] | None = None, method: str | None = None) -> torch.Tensor:
    """x (.., K) @ dequant(W).T + bias in x's dtype. `asym=False` skips the zero points (symmetric schemes);
    `config` = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K]) overrides the choice by row count;
    `method`: "fused" (the GEMM kernel) or "dequant" (whole weight, then cuBLAS); default by rows (DEQUANT_ROWS)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight_int4.shape[0]
    assert weight_int4.shape[1] * 2 == k and k % group_size == 0 and scales.shape == zero_points.shape
    assert scales.stride() == zero_points.stride() and weight_int4.stride(-1) == 1 and scales.stride(-1) == 1
    if (method or ("dequant" if m > DEQUANT_ROWS else "fused")) == "dequant":
        w = dequantize_int4(weight_int4, scales, zero_points, group_size, x.dtype, asym)
        return F.linear(x2, w, None if bias is None else bias.to(x.dtype)).reshape(*x.shape[:-1], n)
    bm, bn, bk, warps, stages, *rest = config or _config(m, n, k, group_size)
    split = max(d for d in range(1, (rest[0] if rest else 1) + 1) if (k // bk) % d == 0)  # divides the K steps
    assert group_size % bk == 0 and bk % 32 == 0, f"BLOCK_K {bk} must divide the group size {group_size}"
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    part = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else out
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    bias_arg = bias if bias is not None else scales
    _int4_gemm_kernel[grid](x2, weight_int4, scales, zero_points, bias_arg, out, part, m, n,
                            x2.stride(0), weight_int4.stride(0), scales.stride(0), out.stride(0),
                            K_STEPS=k // bk, STEPS_PER_GROUP=group_size // bk, HAS_BIAS=bias is not None,
                            ASYM=asym, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                            PRECISION=dot_precision(x.dtype), num_warps=warps, num_stages=stages)
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _split_sum_kernel[(m, triton.cdiv(n, block))](part, bias_arg, out, m, n, out.stride(0), SPLIT_K=split,
                                                      HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out.reshape(*x.shape[:-1], n)
