"""Tensor-core int4 weight-only GEMV for decode steps of 1-32 token rows (CUDA C++ via NVRTC, bf16 activations).

    words = repack_mma(weight_int4)                      # once per weight: int32 [N/16, K/8 * 16] in fragment order
    sw = scale_words(scales, zero_points)                # once per weight: int32 [N, K/G]
    y = int4_mma_gemv(x, words, sw, group_size)          # x (M <= 32, K) bf16 -> (M, N)
    # the fusions of fourfold.quant.int4_gemv: gated=True, residual=r, norm_weight=w (+ eps), bias=b

Why CUDA C++: the weights go through the tensor cores (mma.m16n8k16, bf16 in, float32 sums), which needs the
weight's 4 bits to land directly in the operand registers: a layout Triton's dot cannot be told about. The
token rows are the mma's 8 columns, so 8 rows cost about what one does (H200, llama-1b: a layer's four GEMVs
18.3 us at 8 rows and 15.8 at 1, sums of kernel times), where the Triton GEMV runs a program per row and 2-8 rows
went to torch's int4 mm. 9-32 rows take two to four 8-column tiles per weight fragment (NTILE; llama-1b, a layer's
four GEMVs with their fusions at 9-16 / 24 / 32 rows 26.7-28.1 / 29.6 / 35.1 us against 41-42 / 56 / 56 for int4_gemm
with separate norm and SiLU*mul kernels, bf16 cuBLAS 45-47: bench/int4_two_tile_check.py). At one row it is
0.1-0.6 us faster a GEMV than the Triton one. Not because of its
~4x fewer instructions per weight (a first version with them was no faster): what counts at decode is the latency of
each kernel's chain (wait for the previous kernel, read x, sum, reduce across warps, epilogue), so x is read in
16-byte pieces, the mma sums run as two independent chains (with two tiles or more the tiles' sums are the
independent chains) and the residual is read as soon as the wait ends.

Layout (`repack_mma`, from the stored uint8 [N, K/2] nibbles of fourfold.quant.packing). The mma sums over
its 16 k slots in any order, so each lane's slots are mapped to x elements it can load in two 16-byte reads:
in 64-wide K quad q, lane l = 4g + t holds x[64q + 8t ..+8] and x[64q + 32 + 8t ..+8], k-step j (0..3) taking
4 of them (j < 2 from the first read, so each k-step stays inside one 32-wide half: groups of 32 work). For
16-row block b, one int32 word holds the 8 weights lane l feeds the A operand at k-step j: nibble p (bits
4p..4p+3) is row 16b + g + 8*(p & 1), column 64q + 32*(j >> 1) + 8t + 4*(j & 1) + 2*((p >> 1) & 1) + (p >> 2).
Then `word >> 4i` masked with 0x000F000F and OR-ed with 0x43004300 (one LOP3) is fragment register i: the two
bf16 numbers 128 + u. Words go [block, quad, lane, 4 k-steps], so a lane loads 16 bytes per quad and a warp
512 contiguous bytes. With u = q + 8 stored and weight (q - z) * s, a group's contribution is
    s * (sum_k (128 + u_k) x_k - (136 + z) * sum_k x_k),
the second sum from one more mma with A = ones; `scale_words` packs s (bf16, high half) and 136 + z (low half).
Centred weights (SUBZ, `centered`: above one tile): each fragment register minus the bf16 pair 136 + z (one bf16x2
FMA, exact: the results are the integers u - 8 - z), so the mma sums s-free weights times x and the sum-of-x mma
goes; with several tiles that mma was one per tile, the subtraction is one per fragment. At one row the extra FMA on
each operand's path costs more than the mma it removes (llama-1b layer 16.7 against 16.4 us).
RMSNorm fused (`norm_weight`): sum(x^2) from X X^T on the tensor cores, x * w rounded to bf16 (the separate
norm kernel rounds the normed row too) and rstd applied to the finished sums.
One block of WARPS warps owns 16 output rows (gated: the gate rows and their up rows), its warps split K in
group-aligned ranges and sum through shared memory. Weights and scales are loaded before the kernel waits for
the previous one (programmatic dependent launch on Hopper). Staged form (`staged=True`, STAGE=1; `use_staged`
picks it for 2-8 rows on a wide model and 9-32 rows on any): the weight words go to shared memory by cp.async instead
of registers and x is read quad by quad, so many more blocks of a wide weight are resident and a warp holds one quad
of each tile's x, not its whole range. Needs cuda-bindings (fourfold.ops.nvrtc_launch),
bf16 scales, K a multiple of 64 and N of 16; otherwise callers keep the Triton GEMV.
"""

from __future__ import annotations

import functools
import os

import torch

from fourfold.ops import nvrtc_launch
from fourfold.ops.triton_launch import pdl

TILE_ROWS = 8
"""Token rows of one tile: the mma's 8 columns."""

MAX_TILES = int(os.environ.get("FOURFOLD_INT4_MMA_TILES", "4"))
"""Token tiles one call takes at most (NTILE in the kernel); FOURFOLD_INT4_MMA_TILES=1..4 at import (A/B). Six tiles
(48 rows) were slower through the engine than four are at 32 (H200, llama-1b: 26,611 against 27,299 tok/s)."""
if not 1 <= MAX_TILES <= 4:
    raise ValueError(f"FOURFOLD_INT4_MMA_TILES must be 1 to 4, got {MAX_TILES}")

MAX_ROWS = MAX_TILES * TILE_ROWS
"""Token rows one call takes. Above, fourfold.quant.int4_gemm."""

CENTERED_MODE = os.environ.get("FOURFOLD_INT4_MMA_CENTERED", "auto")
"""Whether a launch takes each group's zero point off in the weight operand (SUBZ=1: u - 8 - z, exact in bf16) instead
of summing x with a second mma and subtracting (136 + z) sum(x) per group: "0", "1", or "auto" (centered)."""


def centered(rows: int) -> bool:
    """Whether a launch of `rows` token rows runs centred weights (CENTERED_MODE)."""
    if CENTERED_MODE in ("0", "1"):
        return CENTERED_MODE == "1"
    return rows > TILE_ROWS

MAX_OUT_FEATURES = 12288
"""At one token row, wider weights (an output head) keep the other kernels: every weight of a block is loaded
before its first mma, so a weight of many 16-row blocks runs in many waves (H200, llama-1b's 32000-row int4 head
at one row: a 0.606 against 0.526 ms decode step). The sweep covered up to 11264 rows (llama-1b's gate|up)."""

MAX_OUT_FEATURES_ROWS = 32768
"""At 2-32 token rows the limit is this: the other kernels there are torch's int4 mm and the W4A16 GEMM, far slower
on wide weights (H200, llama3-8b's gate|up, 28672 rows, at 8 rows: 28.5 us here against 157 us;
bench/int4_mma_check.py --preset llama3-8b)."""

ENABLED = os.environ.get("FOURFOLD_INT4_MMA") != "0"
"""FOURFOLD_INT4_MMA=0 at import keeps every int4 decode step on the Triton GEMV (A/B)."""


def read_kernel_source(name: str) -> str:
    """The text of a CUDA file beside this module (int4_mma_common.cuh's helpers, a kernel)."""
    with open(os.path.join(os.path.dirname(__file__), name)) as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def helpers_source() -> str:
    """The device helpers every int4 tensor-core kernel is compiled after (int4_mma_common.cuh)."""
    return read_kernel_source("int4_mma_common.cuh")


@functools.lru_cache(maxsize=None)
def _source() -> str:
    return helpers_source() + read_kernel_source("int4_mma_gemv.cu")


def layout_supports(x: torch.Tensor, scales: torch.Tensor, in_features: int, out_features: int) -> bool:
    """Whether x (.., K) and an int4 weight with these scales fit the kernels of this layout (this one and
    fourfold.quant.int4_stream) on x's device: cuda-bindings, bf16, 1-32 rows, K a multiple of 64, N of 16, sm80+."""
    rows = x.numel() // in_features if in_features else 0
    return (ENABLED and nvrtc_launch.available() and x.is_cuda and x.dtype == torch.bfloat16
            and scales.dtype == torch.bfloat16 and 0 < rows <= MAX_ROWS and in_features % 64 == 0
            and out_features % 16 == 0 and torch.cuda.get_device_capability(x.device)[0] >= 8)


def supports(x: torch.Tensor, scales: torch.Tensor, in_features: int, out_features: int) -> bool:
    """Whether this kernel can run x (.., K) against an int4 weight with these scales on x's device."""
    rows = x.numel() // in_features if in_features else 0
    staged = use_staged(out_features, in_features, rows)
    return (layout_supports(x, scales, in_features, out_features)
            and out_features <= (MAX_OUT_FEATURES if rows == 1 and not staged else MAX_OUT_FEATURES_ROWS))


def repack_mma(weight_int4: torch.Tensor) -> torch.Tensor:
    """The stored uint8 [N, K/2] nibbles (element 2j high) as int32 words in mma fragment order (module docstring)."""
    n, k = weight_int4.shape[0], weight_int4.shape[1] * 2
    if n % 16 or k % 64:
        raise ValueError(f"the int4 mma layout needs rows a multiple of 16 and columns of 64, got {n} x {k}")
    p = weight_int4.to(torch.int64)
    u = torch.stack([p >> 4, p & 0xF], dim=-1).reshape(n, k)
    # row = 16 b + 8 rh + g; k = 64 q + 32 jh + 8 t + 4 jl + 2 kh + kl (k-step j = 2 jh + jl);
    # nibble p = rh + 2 kh + 4 kl
    u = u.reshape(n // 16, 2, 8, k // 64, 2, 4, 2, 2, 2)       # b, rh, g, q, jh, t, jl, kh, kl
    u = u.permute(0, 3, 2, 5, 4, 6, 8, 7, 1)                    # b, q, g, t, jh, jl, kl, kh, rh
    u = u.reshape(n // 16, k // 64, 32, 4, 8)
    shifts = 4 * torch.arange(8, device=u.device)
    words = (u << shifts).sum(dim=-1)                            # 0 .. 2^32 - 1
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.reshape(n // 16, k // 64 * 128).to(torch.int32).contiguous()


def unpack_mma(words: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of repack_mma: uint8 [N, K] of the values 0..15 in row and k order."""
    w = words.to(torch.int64).reshape(n // 16, k // 64, 32, 4, 1)
    u = (w >> (4 * torch.arange(8, device=w.device))) & 0xF      # b, q, lane, j, p
    u = u.reshape(n // 16, k // 64, 8, 4, 2, 2, 2, 2, 2)        # b, q, g, t, jh, jl, kl, kh, rh
    u = u.permute(0, 8, 2, 1, 4, 3, 5, 7, 6)                     # b, rh, g, q, jh, t, jl, kh, kl
    return u.reshape(n, k).to(torch.uint8)


def scale_words(scales: torch.Tensor, zero_points: torch.Tensor) -> torch.Tensor:
    """int32 [N, K/G]: the bf16 scale's bits in the high half, 136 + zero point in the low half."""
    if scales.dtype != torch.bfloat16:
        raise ValueError(f"the int4 mma kernel takes bf16 scales, got {scales.dtype}")
    high = scales.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    low = zero_points.to(torch.int64) + 136
    words = (high << 16) | low
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32).contiguous()


MAX_WARP_QUADS = 6
"""A warp holds its K range's weights and x in registers: llama-1b's down projection (6 quads a warp at 16 warps)
takes 93 registers; llama3-8b's (14 quads) spilled 336 bytes a thread (sm_90, NVRTC) and took 84 us at one row, so
wider K splits across blocks of SPLIT_WARPS warps."""

SPLIT_WARPS = 4
"""Warps a block when K is split (H200, bench/int4_mma_check.py --preset llama3-8b, one row / 8 rows): the down
projection (K 14336) 17.6 / 18.9 us at 4 warps (K over 10 blocks) against 25.0 / 27.8 at 16 (3 blocks); gate|up
(28672 rows) at 8 rows 28.5 us at 4 warps (3 blocks) against 34.7 at 8 (2 blocks). Splitting K where it is not
needed costs more than it gives (llama-1b: every shape 1-3 us slower split in two), hence only past MAX_WARP_QUADS."""


TWO_TILE_GATED = (SPLIT_WARPS, 4)
"""(warps a block, most quads a warp) of the gated register form at 9-16 token rows (the staged form is the default
there since MANY_TILES_FROM; this is its fallback under FOURFOLD_INT4_STAGE=0), where a warp holds two tiles of x
besides the gate and up weights. H200, llama-1b, a decoder layer's four GEMVs at 9 / 12 / 16 rows in a CUDA graph
(bench/int4_two_tile_check.py): 31.7 / 32.8 / 33.6 us with gate|up at 4 warps (K over 2 blocks) against 33.8 / 35.1 /
35.4 at 8 warps of 4 quads. The other forms keep one tile's rule: llama-1b's down at 16 warps of 6 quads spills 224
bytes a thread with two tiles (sm_90, NVRTC) and is still faster in that layer than 4 quads a warp over 6 blocks."""


MANY_TILES = (16, 2)
"""(warps a block, most quads a warp) of the register form at 17-32 token rows (three or four tiles of x a warp, so
few quads; gated: SPLIT_WARPS warps, whose sums fit MAX_REDUCTION_BYTES). The staged form is the default there
(use_staged); this is its fallback under FOURFOLD_INT4_STAGE=0 (llama-1b layer at 24 / 32 rows: 44.7 / 58.8 us
against 32.4 / 42.8 staged)."""


def config(k: int, group_size: int, gated: bool = False, warps: int | None = None,
           split: int | None = None, max_quads: int | None = None, rows: int = 1) -> tuple[int, int, int]:
    """(WARPS, MAXQ, SPLIT): warps per block (they split K), the most 64-wide quads one warp takes, and how many
    blocks split K. Block sizes from bench/int4_mma_check.py's sweep on an H200 (llama-1b, 1 and 8 rows): 16 warps,
    8 for the gated form. Timed in a decoder layer's chain too (the same script): q|k|v, o and down at 16 warps
    16.7 us at one row and 19.1 at 8 rows, against 17.0 and 20.0 with q|k|v and o at 8. SPLIT by default: the
    fewest blocks that keep a warp's quads at most `max_quads` (MAX_WARP_QUADS), then SPLIT_WARPS warps a block
    unless `warps`. The gated form above TILE_ROWS `rows` takes TWO_TILE_GATED."""
    two_tile_gated = gated and TILE_ROWS < rows <= 2 * TILE_ROWS
    many = ((SPLIT_WARPS if gated else MANY_TILES[0]), MANY_TILES[1]) if rows > 2 * TILE_ROWS else None
    if max_quads is None:
        max_quads = many[1] if many else TWO_TILE_GATED[1] if two_tile_gated else MAX_WARP_QUADS
    unit = max(1, group_size // 64)           # quads per group-aligned unit
    units = k // 64 // unit

    def warp_quads(s: int) -> int:            # a block takes at most ceil(units / s) units, a warp ceil(that / warps)
        return -(-units // (s * warps)) * unit

    if warps is None:
        warps = many[0] if many else TWO_TILE_GATED[0] if two_tile_gated else 8 if gated else 16
        if not many and split is None and warp_quads(1) > max_quads:
            warps = SPLIT_WARPS
    if split is None:
        split = 1
        while warp_quads(split) > max_quads and split < units:
            split += 1
    return warps, warp_quads(split), split


STAGE_WARPS = 8
"""Warps a block of the staged kernel (STAGE=1: weights through shared memory)."""

STAGE_WARP_QUADS = 8
"""Quads a warp of the staged kernel takes at most (4 KiB of shared memory a warp, 8 KiB gated)."""

STAGE_MODE = os.environ.get("FOURFOLD_INT4_STAGE", "auto")
"""Which decode launches run staged: "0" none, "1" all, "auto" those of 2-8 token rows on weights whose two
dimensions are both at least STAGE_MIN_DIM and every one of MANY_TILES_FROM rows or more. H200, a decoder layer's
four GEMVs in a CUDA graph (bench/int4_mma_check.py --preset llama3-8b --layers-only, same machine): at 8 rows 82.8 us a layer with the
register kernels, 65.3 with all four staged, but 71.4 with only gate|up and down staged: a layer that mixes the two
kinds runs slower than either, so the rule takes every weight of a wide model or none. At one row all staged is
60.4 against 58.9 (alone the staged kernels win: gate|up 23.3 against 25.2 us), and llama-1b's shapes gain nothing
(its layer 21.1-21.6 us all staged against 18.5-19.4). At 9-16 rows (two tiles) llama3-8b's staged layer takes
103.8-106.0 us against 112.3-113.3 on int4_gemm with separate norm kernels (bench/int4_two_tile_check.py)."""

STAGE_MIN_DIM = 4096
"""Both dimensions of a weight from which "auto" stages launches of 2-8 rows: every decoder weight of a model of
width 4096 (llama3-8b), none of llama-1b's (width 2048)."""

CARVEOUT = int(os.environ["FOURFOLD_INT4_CARVEOUT"]) if os.environ.get("FOURFOLD_INT4_CARVEOUT") else None
"""FOURFOLD_INT4_CARVEOUT=P: every launch of this kernel prefers P percent of L1 as shared memory (A/B; no
measured gain: the llama3-8b layer at one row, all staged, 64.9 us with P = 100, 60.4-60.8 without)."""


MANY_TILES_FROM = TILE_ROWS + 1
"""Token rows from which every launch runs staged with MANY_TILES_STAGED (and the gated form's MINB): two tiles or
more. H200, a decoder layer's four GEMVs at 9 / 12 / 16 rows (bench/int4_two_tile_check.py): llama-1b 26.7 / 28.1 /
27.8 us against 29.2 / 31.0 / 31.6 in the register form (TWO_TILE_GATED), llama3-8b at 12 / 16 rows 91.8 / 91.1
against 94.8 / 95.3 with STAGE_WARPS and STAGE_WARP_QUADS."""

MANY_TILES_STAGED = {False: (8, 8), True: (4, 8)}
"""(warps a block, most quads a warp) of the staged kernel from MANY_TILES_FROM rows, plain and gated. From the
per-kernel sweep at 32 rows (bench/int4_two_tile_check.py, H200): llama-1b q|k|v 4.9 us (cuBLAS 6.9), gate|up 13.1
(14.1), down 8.9 at K over 2 blocks (11.9); llama3-8b q|k|v 15.9 (17.4), o 9.2 (14.1), gate|up 51.5 over 2 blocks
(58.0), down 37.9 over 4 (33.1). o of llama-1b alone is faster in the register form (4.2 against 4.9 us), but the layer
with it was not (33.1 against 32.4 us at 24 rows)."""

MANY_TILES_GATED_MIN_BLOCKS = 3
"""MINB of a staged gated launch from MANY_TILES_FROM rows: 3 blocks of 4 warps an SM, so up to 168 registers a
thread. With 4 (128 registers) the gated form with its fused norm spilled 400 bytes a thread at 32 rows (sm_90, NVRTC); H200,
llama-1b, a decoder layer's four GEMVs at 24 / 32 rows: 29.6 / 35.1 us against 32.5 / 42.7 with 4 (2: 29.6 / 35.6)."""


def use_staged(out_features: int, in_features: int, rows: int) -> bool:
    """Whether a decode launch of `rows` token rows on this weight runs staged (STAGE_MODE): in "auto", 2-8 rows
    on a wide weight (STAGE_MIN_DIM) and every launch of MANY_TILES_FROM rows or more (two to four tiles of x)."""
    if STAGE_MODE in ("0", "1"):
        return STAGE_MODE == "1"
    return rows >= MANY_TILES_FROM or (rows > 1 and min(out_features, in_features) >= STAGE_MIN_DIM)


def staged_config(k: int, group_size: int, gated: bool = False, warps: int | None = None,
                  max_quads: int | None = None, split: int | None = None, rows: int = 1) -> tuple[int, int, int]:
    """(WARPS, MAXQ, SPLIT) of the staged kernel: `warps` a block, K split over the fewest blocks that keep a warp's
    quads at most `max_quads` (defaults: STAGE_WARPS and STAGE_WARP_QUADS, MANY_TILES_STAGED from MANY_TILES_FROM
    rows)."""
    many = MANY_TILES_STAGED[gated] if rows >= MANY_TILES_FROM else (STAGE_WARPS, STAGE_WARP_QUADS)
    return config(k, group_size, gated, warps=warps or many[0], split=split, max_quads=max_quads or many[1])


MAX_SHARED_BYTES = 200 * 1024
"""Dynamic shared memory a staged launch may take (Hopper: 227 KiB a block, less the reduction's static array)."""


def min_blocks(warps: int, gated: bool = False, rows: int = 1) -> int:
    """MINB of a staged launch: blocks an SM must fit by registers, 512 threads' worth (so at most 128 registers a
    thread; shared memory, not registers, then bounds how many blocks are resident); MANY_TILES_GATED_MIN_BLOCKS
    for the gated form from MANY_TILES_FROM rows."""
    if gated and rows >= MANY_TILES_FROM:
        return MANY_TILES_GATED_MIN_BLOCKS
    return max(1, 16 // warps)


def staged_shared_bytes(warps: int, maxq: int, gated: bool) -> int:
    """Dynamic shared memory of a staged launch: each warp's quads of weight words (gate and up: twice)."""
    return warps * maxq * (2 if gated else 1) * 512


SPLIT_VALUES = 10 * MAX_TILES
"""Float32 sums a lane of a split block stores: the kernel's NRED at most (per token tile gate and up, 4 each, and 2
squares)."""


MAX_REDUCTION_BYTES = 48 * 1024
"""The kernel's static shared memory for the warps' sums (red[NRED][WARPS][32] floats) may take at most this."""


def reduction_bytes(warps: int, rows: int, gated: bool, norm: bool) -> int:
    """Static shared memory of a launch's cross-warp sums: NVAL sums a lane per token tile (4, gate and up 8, the
    fused norm's 2 squares more), WARPS warps of 32 lanes."""
    nval = 4 + 4 * gated + 2 * norm
    return nval * -(-rows // TILE_ROWS) * warps * 32 * 4


def split_workspace(row_blocks: int, split: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial sums, tickets) for a launch with SPLIT > 1: float32 [row blocks, SPLIT, SPLIT_VALUES, 32 lanes],
    and int32 [row blocks] zeros that the kernel leaves zero. Kernels on one stream may share one."""
    return (torch.empty(row_blocks * split * SPLIT_VALUES * 32, device=device, dtype=torch.float32),
            torch.zeros(row_blocks, device=device, dtype=torch.int32))


def int4_mma_gemv(x: torch.Tensor, words: torch.Tensor, scale_words_: torch.Tensor, group_size: int,
                  bias: torch.Tensor | None = None, gated: bool = False, residual: torch.Tensor | None = None,
                  norm_weight: torch.Tensor | None = None, eps: float = 1e-5,
                  launch_config: tuple[int, int, int] | None = None,
                  workspace: tuple[torch.Tensor, torch.Tensor] | None = None, staged: bool = False,
                  centered_weights: bool | None = None) -> torch.Tensor:
    """x (.., K) bf16 @ dequant(W).T + bias; `gated`: silu(first half of the rows) * second half; `residual`:
    added (rounded as an eager residual add); `norm_weight`: x RMS-normalised (eps) and scaled by it first.
    A launch whose config splits K across blocks needs `workspace` (split_workspace, made outside graph capture).
    `staged`: the weights go through shared memory (STAGE=1; launch_config then defaults to staged_config).
    `centered_weights`: SUBZ (None: `centered(rows)`)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:   # the kernel reads x in 16-byte pieces
        x2 = x2.clone(memory_format=torch.contiguous_format)
    if norm_weight is not None and norm_weight.data_ptr() % 16:
        norm_weight = norm_weight.clone()
    rows, n_total = x2.shape[0], words.shape[0] * 16
    n = n_total // 2 if gated else n_total
    assert rows <= MAX_ROWS and k % 64 == 0 and words.shape[1] == k // 64 * 128 and n % 16 == 0
    ntile = -(-rows // TILE_ROWS)
    assert scale_words_.shape == (n_total, k // group_size) and scale_words_.is_contiguous()
    out = torch.empty(rows, n, device=x.device, dtype=torch.bfloat16)
    res = None
    if residual is not None:
        res = residual.reshape(rows, n)
        assert res.stride(-1) == 1 and res.dtype == torch.bfloat16
    for t in (bias, norm_weight):
        assert t is None or (t.dtype == torch.bfloat16 and t.is_contiguous())
    warps, maxq, split = launch_config or (staged_config(k, group_size, gated, rows=rows) if staged
                                           else config(k, group_size, gated, rows=rows))
    shared = staged_shared_bytes(warps, maxq, gated) if staged else 0
    if reduction_bytes(warps, rows, gated, norm_weight is not None) > MAX_REDUCTION_BYTES:
        raise ValueError(f"{warps} warps a block at {rows} token rows need more than {MAX_REDUCTION_BYTES} bytes for "
                         f"their sums: give fewer warps (int4_mma.config)")
    if shared > MAX_SHARED_BYTES:
        raise ValueError(f"a staged launch of {warps} warps x {maxq} quads needs {shared} bytes of shared memory, more "
                         f"than {MAX_SHARED_BYTES}: give fewer warps or quads a warp (staged_config)")
    partial = tickets = None
    if split > 1:
        row_blocks = words.shape[0]
        if (workspace is None or workspace[1].numel() < row_blocks
                or workspace[0].numel() < row_blocks * split * SPLIT_VALUES * 32):
            raise ValueError(f"a launch that splits K over {split} blocks needs a workspace (int4_mma.split_workspace)")
        partial, tickets = workspace
    use_pdl = pdl(x.device)
    defines = {"WARPS": warps, "MAXQ": maxq, "GS": group_size // 16, "SPLIT": split, "GATED": int(gated),
               "NORM": int(norm_weight is not None), "RES": int(res is not None), "BIAS": int(bias is not None),
               "PDL": int(use_pdl), "STAGE": int(staged), "MINB": min_blocks(warps, gated, rows) if staged else 1,
               "NTILE": ntile,
               "SUBZ": int(centered(rows) if centered_weights is None else centered_weights)}
    kernel = nvrtc_launch.compiled_kernel(_source(), "int4_mma_gemv", defines, x.device)
    nvrtc_launch.launch(kernel, n // 16 * split, warps * 32,
                        [words, scale_words_, x2, norm_weight, bias, res, out, partial, tickets, rows, k, n, x2.stride(0),
                         res.stride(0) if res is not None else 0, out.stride(0), float(eps)], x.device, pdl=use_pdl,
                        shared_bytes=shared, carveout=CARVEOUT)
    return out.reshape(*x.shape[:-1], n)
