"""Triton int4 weight-only GEMV for few-token steps, reading the stored nibbles directly (no repacking).

    y = int4_gemv(x, weight_int4, scales, zero_points, group_size, bias)       # x (M, K), M small; y (M, N)
    act = int4_gemv(x, ..., gated=True)     # silu(x @ gate.T) * (x @ up.T) for rows stacked [gate | up]

Weights in fourfold.quant.packing's stored layout: uint8 [N, K/2] holding u = q + 8 (element 2j in the high
nibble, 2j+1 in the low one), scales [N, K/G] (bf16 or fp32), int8 zero points [N, K/G]; the weight is
(u - 8 - z) * s, so per group  sum_k w_k x_k = s * (sum_k (u_k - 8) x_k - z * sum_k x_k),  which lets a program
multiply raw nibbles and apply scale and zero point once per group. One program owns BLOCK_N output rows
and one token row; it walks GPI groups at a time (16-byte loads of packed bytes, 4x fewer bytes than bf16),
accumulating in float32. Token rows of one weight tile are adjacent in the grid, so the packed tile comes
from HBM once and from L2 for the other rows. Asymmetric schemes subtract z * sum(x) per group; symmetric
ones skip it. Nibbles become floats through their bits (2^23 + u, minus 2^23 + 8), not int->float
conversions. The grid depends only on shapes, so the call can be captured in a CUDA graph; on Hopper it
launches with programmatic dependent launch like fourfold.infer.gemv_gpu.
Status (H200, bench/gemv_check.py): correct for every scheme, but instruction-bound at 0.5-1.3 TB/s of
packed bytes, slower than torch's `_weight_int4pack_mm` in CUDA graphs at one row, so MAX_ROWS is 0 and
it is not on the decode path; kept for the gated (SiLU*mul) form and as the base for a faster one.
"""

from __future__ import annotations

import torch

from fourfold.ops.triton_launch import pdl, triton

MAX_ROWS = 0
"""Up to this many token rows (on CUDA) use this kernel; more use torch's tile-packed `_weight_int4pack_mm`.
0 (off): on an H200 inside CUDA graphs torch's kernel was faster at every llama-1b shape (bench/gemv_check.py:
q|k|v 4.0 vs 5.5 us, down 6.6 vs 10.7 us at one row), so the converted model decodes through it."""

if triton is not None:
    import triton.language as tl

    from fourfold.ops.triton_launch import pdl_signal, pdl_wait, swiglu_rounded

    @triton.jit
    def _int4_gemv_kernel(x_ptr, p_ptr, s_ptr, z_ptr, b_ptr, out_ptr, N, stride_xm, stride_pn,
                          stride_sn, stride_om, up_offset,
                          N_GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ASYM: tl.constexpr,
                          G: tl.constexpr, GPI: tl.constexpr,
                          BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        pdl_signal(PDL)
        pdl_wait(PDL)
        m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        rows64 = rows.to(tl.int64)
        gi = tl.arange(0, GPI)
        j = tl.arange(0, G // 2)
        acc = tl.zeros([BLOCK_N, GPI], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, GPI], dtype=tl.float32)
        pair = tl.arange(0, 2)
        for step in range((N_GROUPS + GPI - 1) // GPI):  # constexpr trip count (also in the interpreter)
            grp = step * GPI + gi
            g_ok = grp < N_GROUPS
            # x as (GPI, G/2, 2) contiguous pairs, split into the elements of the high and low nibbles
            k_pair = grp[:, None, None] * G + 2 * j[None, :, None] + pair[None, None, :]
            xv = tl.load(x_ptr + m * stride_xm + k_pair, mask=g_ok[:, None, None], other=0.0).to(tl.float32)
            xe, xo = tl.split(xv)
            byte = grp[:, None] * (G // 2) + j[None, :]
            mask3 = row_ok[:, None, None] & g_ok[None, :, None]
            mask2 = row_ok[:, None] & g_ok[None, :]
            if ASYM:
                xsum = tl.sum(xe + xo, axis=1)                                # (GPI,)
            for half in tl.static_range(2 if GATED else 1):                   # gate rows, then up rows
                r = rows64 + half * up_offset
                p = tl.load(p_ptr + r[:, None, None] * stride_pn + byte[None, :, :], mask=mask3, other=0x88)
                p = p.to(tl.int32)
                # u - 8 exactly, without int->float conversions: the bits of 2^23 + u, minus 2^23 + 8
                hi = ((p >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
                lo = ((p & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
                dot = tl.sum(hi * xe[None, :, :] + lo * xo[None, :, :], axis=2)  # (BLOCK_N, GPI)
                sz = r[:, None] * stride_sn + grp[None, :]
                s = tl.load(s_ptr + sz, mask=mask2, other=0.0).to(tl.float32)
                if ASYM:
                    dot -= tl.load(z_ptr + sz, mask=mask2, other=0).to(tl.float32) * xsum[None, :]
                if half == 0:
                    acc += s * dot
                else:
                    acc_up += s * dot
        y = tl.sum(acc, axis=1)
        out_ty = out_ptr.dtype.element_ty
        if HAS_BIAS:
            y = y + tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if GATED:  # rounded where the eager SwiGLU rounds: each matmul output, silu, the product
            up = tl.sum(acc_up, axis=1)
            if HAS_BIAS:
                up = up + tl.load(b_ptr + up_offset + rows, mask=row_ok, other=0.0).to(tl.float32)
            y = swiglu_rounded(y, up, out_ptr)
        tl.store(out_ptr + m * stride_om + rows, y.to(out_ty), mask=row_ok)


def available() -> bool:
    """Whether Triton imported, so `int4_gemv` can run (on CUDA tensors, or under TRITON_INTERPRET=1)."""
    return triton is not None


def _config(n: int, group_size: int) -> tuple[int, int, int]:
    """(BLOCK_N, groups per iteration, num_warps): the best of bench/gemv_check.py's sweep on an H200 at one row
    (group 128: 4 rows x 8 groups, 8 warps for the 2048-row matrices; 8 rows x 8 groups, 4 warps for gate|up)."""
    gpi = max(1, 1024 // group_size)
    return (4, gpi, 8) if n <= 4096 else (8, gpi, 4)


def int4_gemv(x: torch.Tensor, weight_int4: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor,
              group_size: int, bias: torch.Tensor | None = None, gated: bool = False,
              config: tuple[int, int, int] | None = None, asym: bool = True) -> torch.Tensor:
    """x (.., K) @ dequant(W).T + bias in x's dtype; `gated`: silu(first half) * second half of the rows.
    `asym=False` skips the zero points (all zero: symmetric schemes)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, n_total = x2.shape[0], weight_int4.shape[0]
    n = n_total // 2 if gated else n_total
    assert weight_int4.shape[1] * 2 == k and k % group_size == 0 and scales.shape == zero_points.shape
    assert scales.stride() == zero_points.stride() and weight_int4.stride(-1) == 1
    block_n, gpi, warps = config or _config(n, group_size)
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    grid = (rows, triton.cdiv(n, block_n))
    groups = k // group_size
    _int4_gemv_kernel[grid](x2, weight_int4, scales, zero_points, bias if bias is not None else scales, out, n, x2.stride(0),
                            weight_int4.stride(0), scales.stride(0), out.stride(0), n, N_GROUPS=groups,
                            HAS_BIAS=bias is not None, GATED=gated, ASYM=asym, G=group_size, GPI=gpi,
                            BLOCK_N=block_n, PDL=pdl(x.device), num_warps=warps, launch_pdl=pdl(x.device))
    return out.reshape(*x.shape[:-1], n)
