"""Triton GEMV for decode steps with few tokens: y = x @ W.T (+ b) for x (M <= MAX_ROWS, K) and a bf16 W (N, K).

    y = gemv(x, weight, bias)                # (M, N); cuBLAS (F.linear) for more rows, CPU and no Triton
    act = gemv(x, gate_up, gated=True)       # silu(x @ gate.T) * (x @ up.T), gate_up = [gate | up] by rows

cuBLAS runs the 1.1B model's batch-1 matmuls at 1.4-3.7 TB/s on an H200 (the small ones slowest), so a
decode step's weight read is far from bandwidth. Here one program owns BLOCK_N consecutive output rows and
one token row of x: it walks K in BLOCK_K-wide tiles with 16-byte loads, multiplies in float32 and keeps
elementwise partial sums, reducing once at the end. On Hopper it launches with programmatic dependent
launch (fourfold.ops.triton_launch.pdl): the first weight tile is loaded before waiting for the kernel
that produced x, so the load latency overlaps the previous (small) kernel. Measured on an H200 in CUDA
graphs at one row (bench/gemv_check.py): q|k|v 3.3 us vs cuBLAS 6.3, o 3.1 vs 6.2, gate|up with SiLU*mul
11.9 vs 15.6 + 1.3, down 7.4 vs 11.2, head 31.0 vs 35.7 (2.7-4.2 TB/s). Programs for the M token rows of one weight tile are
adjacent in the grid (token is the fastest grid axis), so the weight tile comes from HBM once and from L2
for the other rows. The grid depends only on shapes (capturable in a CUDA graph). `gated` gives a program
the matching gate and up rows and writes silu(gate) * up, rounded where the eager SwiGLU rounds (each
matmul output to the activation dtype, silu to it, the product to it), so the fused decoder skips the
separate SiLU*mul kernel and the (M, 2 ffn) intermediate. Tile sizes per shape: `_config`, chosen from the
sweep of bench/gemv_check.py on an H200.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fourfold.ops.triton_launch import pdl, triton
from fourfold.infer.fused_ops import silu_mul

MAX_ROWS = 2
"""Up to this many token rows use the Triton GEMV; more go to cuBLAS (bench/gemv_check.py on an H200: at 2 rows
it still beats cuBLAS on q|k|v, o and gate|up, at 4 on none; each row costs about what one row does)."""

if triton is not None:
    import triton.language as tl

    from fourfold.ops.triton_launch import pdl_signal, pdl_wait, swiglu_rounded

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, stride_xm, stride_wn, stride_om, up_offset,
                     K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pdl_signal(PDL)
        m, pid_n = tl.program_id(0), tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        cols = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
        u_rows = w_rows + up_offset * stride_wn
        # the first weight tile does not depend on the previous kernel: load it before waiting for that one
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
        if GATED:
            u = tl.load(u_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
        pdl_wait(PDL)
        xk = tl.load(x_ptr + m * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc = w.to(tl.float32) * xk[None, :]
        if GATED:
            acc_up = u.to(tl.float32) * xk[None, :]
        for step in range(1, K // BLOCK_K + (0 if EVEN_K else 1)):  # constexpr trip count (also in the interpreter)
            k = step * BLOCK_K + cols
            if EVEN_K:
                xk = tl.load(x_ptr + m * stride_xm + k).to(tl.float32)
                w = tl.load(w_rows + k[None, :], mask=row_ok[:, None], other=0.0)
            else:
                xk = tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
                w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
            acc += w.to(tl.float32) * xk[None, :]
            if GATED:
                if EVEN_K:
                    u = tl.load(u_rows + k[None, :], mask=row_ok[:, None], other=0.0)
                else:
                    u = tl.load(u_rows + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
                acc_up += u.to(tl.float32) * xk[None, :]
        y = tl.sum(acc, axis=1)
        out_ty = out_ptr.dtype.element_ty
        if HAS_BIAS:
            y = y + tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if GATED:
            up = tl.sum(acc_up, axis=1)
            if HAS_BIAS:
                up = up + tl.load(b_ptr + up_offset + rows, mask=row_ok, other=0.0).to(tl.float32)
            y = swiglu_rounded(y, up, out_ptr)
        tl.store(out_ptr + m * stride_om + rows, y.to(out_ty), mask=row_ok)


def _config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an (n, k) weight: the fastest of bench/gemv_check.py's sweep on an H200
    at one row (2 rows a program: 1,024 to 16,000 programs; 2 KB of weight per row per iteration)."""
    if k > 4096:
        return 2, 512, 8
    return 2, min(1024, triton.next_power_of_2(k)), 4


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv` runs the Triton kernel for x (.., K) against weight (N, K) (else F.linear)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (triton is not None and x.is_cuda and weight.is_cuda and 0 < rows <= MAX_ROWS
            and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
            and weight.stride(-1) == 1 and weight.dim() == 2)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
                config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The Triton kernel itself, for any row count (bench/gemv_check.py sweeps `config`); see `gemv`."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, n_total = x2.shape[0], weight.shape[0]
    n = n_total // 2 if gated else n_total
    block_n, block_k, warps = config or _config(n, k)
    out = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    grid = (rows, triton.cdiv(n, block_n))
    _gemv_kernel[grid](x2, weight, bias if bias is not None else weight, out, n, x2.stride(0), weight.stride(0),
                       out.stride(0), n, K=k, HAS_BIAS=bias is not None, GATED=gated, EVEN_K=k % block_k == 0,
                       BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl(x.device), num_warps=warps,
                       launch_pdl=pdl(x.device))
    return out.reshape(*x.shape[:-1], n)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """x @ weight.T + bias (or, gated, silu of the first half of the outputs times the second half)."""
    if use_gemv(x, weight):
        return gemv_triton(x, weight, bias, gated)
    y = F.linear(x, weight, bias)
    return silu_mul(y.reshape(-1, y.shape[-1])).reshape(*y.shape[:-1], -1) if gated else y
