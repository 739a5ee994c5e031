"""Triton W4A16 GEMM for many-token steps: bf16 activations times int4 weights dequantized in registers.

    y = int4_gemm(x, weight_int4, scales, zero_points, group_size, bias)     # x (.., K) -> y (.., N)

Weights in fourfold.quant.packing's stored layout, read as they are (no repacking, no extra memory): uint8
[N, K/2] holding u = q + 8 (element 2j in the high nibble, 2j+1 in the low one), scales [N, K/G], int8 zero
points [N, K/G]; the weight is (u - 8 - z) * s. One program owns a BLOCK_M x BLOCK_N output tile and walks K
in BLOCK_K steps; BLOCK_K divides the group size, so each k-step needs one scale (and zero point) per output
row. A step loads BLOCK_K/2 packed bytes per output row, splits them into the high-nibble (even k) and
low-nibble (odd k) halves, dequantizes each to x's dtype and multiplies it with the matching even / odd
columns of x: two `tl.dot`s of depth BLOCK_K/2 into one float32 accumulator. K needs no edge mask (K is a
multiple of the group size, hence of BLOCK_K); M and N do. The grid depends only on shapes (CUDA graphs).

torch's tile-packed `_weight_int4pack_mm` (tinygemm) is faster at a few rows but falls far behind cuBLAS bf16
from ~16 rows on an H200, so Int4WeightLinear runs this kernel above TINYGEMM_ROWS rows on CUDA.
bench/int4_gemm_check.py checks it and times it against both on the llama-1b shapes.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the int4 modules use torch's CPU kernel
    triton = None

TINYGEMM_ROWS = 4
"""On CUDA, steps of at most this many token rows use torch's `_weight_int4pack_mm`; more use int4_gemm
(bench/int4_gemm_check.py on an H200: see bench/results/2026-11-24-h200-int4gemm/)."""

METHOD = os.environ.get("FOURFOLD_INT4_GEMM", "join")
"""The fused kernel's form: "join" (one dot per k-step) or "split" (two dots over even / odd columns of x)."""
DEQUANT_ROWS = int(os.environ.get("FOURFOLD_INT4_DEQUANT_ROWS", "0"))
"""Above this many rows (0: never) dequantize the whole weight to x's dtype and call cuBLAS instead."""

if triton is not None:

    @triton.jit
    def _dequant_tile(p, s, z, ASYM: tl.constexpr, out_ty: tl.constexpr):
        """Packed bytes p (int32; rows x bytes) to weights (u - 8 - z) * s in out_ty: (high, low) nibble tiles."""
        hi = (p >> 4) - 8
        lo = (p & 0xF) - 8
        if ASYM:
            hi -= z
            lo -= z
        return (hi.to(tl.float32) * s).to(out_ty), (lo.to(tl.float32) * s).to(out_ty)

    @triton.jit
    def _int4_gemm_kernel(x_ptr, p_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N,
                          stride_xm, stride_pn, stride_sn, stride_om,
                          K_STEPS: tl.constexpr, STEPS_PER_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                          ASYM: tl.constexpr, JOIN: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)   # m fastest: programs sharing a weight tile run together
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
        j = tl.arange(0, BLOCK_K // 2)                          # byte j of a k-step holds k = 2j (high), 2j+1 (low)
        kk = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + rm64[:, None] * stride_xm
        x_ty = x_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for step in range(K_STEPS):
            group = step // STEPS_PER_GROUP
            s = tl.load(s_ptr + rn64 * stride_sn + group, mask=n_ok, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + rn64 * stride_sn + group, mask=n_ok, other=0).to(tl.int32) if ASYM else 0
            byte = step * (BLOCK_K // 2) + j
            if JOIN:   # weights as stored (BLOCK_N, BLOCK_K/2) -> (BLOCK_N, BLOCK_K) in k order -> one dot
                p = tl.load(p_ptr + rn64[:, None] * stride_pn + byte[None, :], mask=n_ok[:, None], other=0x88)
                z2 = z[:, None] if ASYM else 0
                w_hi, w_lo = _dequant_tile(p.to(tl.int32), s[:, None], z2, ASYM, x_ty)
                w = tl.reshape(tl.join(w_hi, w_lo), (BLOCK_N, BLOCK_K))
                xv = tl.load(x_rows + step * BLOCK_K + kk[None, :], mask=m_ok[:, None], other=0.0)
                acc = tl.dot(xv, tl.trans(w), acc)
            else:      # (BLOCK_K/2, BLOCK_N) tiles of high and low nibbles times even and odd columns of x: two dots
                p = tl.load(p_ptr + rn64[None, :] * stride_pn + byte[:, None], mask=n_ok[None, :], other=0x88)
                z2 = z[None, :] if ASYM else 0
                w_hi, w_lo = _dequant_tile(p.to(tl.int32), s[None, :], z2, ASYM, x_ty)
                x_even = tl.load(x_rows + 2 * byte[None, :], mask=m_ok[:, None], other=0.0)
                x_odd = tl.load(x_rows + 2 * byte[None, :] + 1, mask=m_ok[:, None], other=0.0)
                acc = tl.dot(x_even, w_hi, acc)
                acc = tl.dot(x_odd, w_lo, acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rm64[:, None] * stride_om + rn64[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

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


def _config(m: int, n: int, group_size: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by row count; BLOCK_N shrinks until the grid has
    about one program per SM (H200: 132) so the 2048-row llama-1b matrices still fill the GPU."""
    if m <= 16:
        bm, bn, warps = 16, 64, 4
    elif m <= 32:
        bm, bn, warps = 32, 64, 4
    elif m <= 64:
        bm, bn, warps = 64, 64, 4
    else:
        bm, bn, warps = 128, 128, 8
    while bn > 32 and triton.cdiv(m, bm) * triton.cdiv(n, bn) < 132:
        bn //= 2
    return bm, bn, min(128, group_size), warps, 3


def dequantize_int4(weight_int4: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, group_size: int,
                    dtype: torch.dtype, asym: bool = True) -> torch.Tensor:
    """The (N, K) weight (u - 8 - z) * s in `dtype` from the stored nibbles (one Triton kernel)."""
    n, k = weight_int4.shape[0], weight_int4.shape[1] * 2
    bn, bk = 64, min(128, group_size)
    w = torch.empty(n, k, device=weight_int4.device, dtype=dtype)
    _dequant_kernel[(triton.cdiv(n, bn), k // bk)](weight_int4, scales, zero_points, w, n, k, weight_int4.stride(0),
                                                   scales.stride(0), G=group_size, ASYM=asym, BLOCK_N=bn, BLOCK_K=bk)
    return w


def int4_gemm(x: torch.Tensor, weight_int4: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor,
              group_size: int, bias: torch.Tensor | None = None, asym: bool = True,
              config: tuple[int, int, int, int, int] | None = None, method: str | None = None) -> torch.Tensor:
    """x (.., K) @ dequant(W).T + bias in x's dtype. `asym=False` skips the zero points (symmetric schemes);
    `config` = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) overrides the choice by row count;
    `method`: "join" / "split" (the fused kernel's forms) or "dequant" (whole weight, then cuBLAS)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight_int4.shape[0]
    assert weight_int4.shape[1] * 2 == k and k % group_size == 0 and scales.shape == zero_points.shape
    assert scales.stride() == zero_points.stride() and weight_int4.stride(-1) == 1 and scales.stride(-1) == 1
    method = method or ("dequant" if 0 < DEQUANT_ROWS < m else METHOD)
    if method == "dequant":
        w = dequantize_int4(weight_int4, scales, zero_points, group_size, x.dtype, asym)
        y = F.linear(x2, w, None if bias is None else bias.to(x.dtype))
        return y.reshape(*x.shape[:-1], n)
    bm, bn, bk, warps, stages = config or _config(m, n, group_size)
    assert group_size % bk == 0 and bk % 32 == 0, f"BLOCK_K {bk} must divide the group size {group_size}"
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _int4_gemm_kernel[grid](x2, weight_int4, scales, zero_points, bias if bias is not None else scales, out, m, n,
                            x2.stride(0), weight_int4.stride(0), scales.stride(0), out.stride(0),
                            K_STEPS=k // bk, STEPS_PER_GROUP=group_size // bk, HAS_BIAS=bias is not None,
                            ASYM=asym, JOIN=method == "join", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                            num_warps=warps, num_stages=stages)
    return out.reshape(*x.shape[:-1], n)
