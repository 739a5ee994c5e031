"""One-token-row int4 GEMV that streams a wide weight through shared memory (CUDA C++ via NVRTC, bf16 activations).

    words, sw = int4_mma.repack_mma(w_int4), int4_mma.scale_words(scales, zero_points)   # int4_mma's layout
    y = int4_stream_gemv(x, words, sw, group_size)        # x (1, K) bf16 -> (1, N); the fusions of int4_mma too

Why: a one-row decode GEMV must at least read its weight, and `bench/read_floor.py` measures how fast a dependent
kernel can merely do that on the GPU at hand. On an H200 the engine's int4 GEMVs on llama3-8b's shapes took 1.7-2.1x
that floor (gate|up 26.4 us against 16.0, down 17.6 against 8.3): int4_mma_gemv gives each 16-row tile its own
block, which loads all its weights, computes, and exits, so a wide weight runs in waves with idle gaps in between,
and the best pure reads kept ~128 KiB in flight on every SM. This kernel (int4_stream_gemv.cu) runs at most one
block an SM; the block takes tiles in grid-stride order and its warps stream their weight words through a ring of
cp.async slots, RING quads a warp in flight, the first before the PDL wait. The math, the K split over warps and
the order of every sum are int4_mma_gemv's (same WARPS, SPLIT = 1), so the output is the same bit for bit.

One token row only: x is staged once in shared memory at the mma's B positions, which for one row takes K * 2
bytes (at 8 rows the staged int4_mma kernel serves). Needs what int4_mma needs (cuda-bindings, bf16, K a multiple
of 64, N of 16).
"""

from __future__ import annotations

import functools
import os

import torch

from fourfold.ops import nvrtc_launch
from fourfold.ops.triton_launch import pdl
from fourfold.quant import int4_mma

WARPS = 16
"""Warps a block (they split K as int4_mma_gemv's warps do; at most 16: the reduction buffers are static shared
memory, 48 KiB at most)."""

RING_BYTES = 64 * 1024
"""Weight bytes a block keeps in flight: 16 warps x 8 quads (4 gate|up pairs). H200, llama3-8b's shapes at one row
(bench/int4_stream_check.py): q|k|v 7.5 us at 64 KiB against 7.9 at 128, down 14.9 against 15.8, gate|up 22.1
against 23.5; o 5.95 against 5.84."""

BLOCKS_PER_SM = 1
"""Blocks an SM of the default grid (one: a block's ring is most of the SM's shared memory)."""

MODE = os.environ.get("FOURFOLD_INT4_STREAM", "auto")
"""Which one-row decode launches stream: "0" none, "1" all it supports, "auto" weights whose two dimensions are
both at least MIN_DIM."""

MIN_DIM = 4096
"""Both dimensions of a weight from which "auto" streams one-row launches (every decoder weight of llama3-8b)."""


@functools.lru_cache(maxsize=None)
def _source() -> str:
    return int4_mma.helpers_source() + int4_mma.read_kernel_source("int4_stream_gemv.cu")


def use_stream(out_features: int, in_features: int, rows: int) -> bool:
    """Whether a decode launch of `rows` token rows on this weight streams (MODE)."""
    if rows != 1 or MODE == "0":
        return False
    return MODE == "1" or min(out_features, in_features) >= MIN_DIM


def stream_config(k: int, group_size: int, gated: bool = False, warps: int = WARPS,
                  ring: int | None = None) -> tuple[int, int, int]:
    """(WARPS, RING, MAXQ): warps a block, quads a warp keeps in flight (RING_BYTES over the block by default, a power
    of two), and the most quads a warp takes of one tile (group-aligned shares of K, as int4_mma.config)."""
    if not 1 <= warps <= 16:
        raise ValueError(f"the streaming int4 GEMV takes 1-16 warps a block, got {warps}")
    unit = max(1, group_size // 64)
    units = k // 64 // unit
    maxq = -(-units // warps) * unit
    if ring is None:
        ring = 1 << max(0, (RING_BYTES // (warps * 512 * (2 if gated else 1))).bit_length() - 1)
    if ring < 1 or ring & (ring - 1):
        raise ValueError(f"the ring holds a power of two of quads a warp, got {ring}")
    return warps, ring, maxq


def shared_bytes(warps: int, ring: int, k: int, gated: bool) -> int:
    """Dynamic shared memory of a launch: the warps' rings of weight words and x at the B positions."""
    return warps * ring * (2 if gated else 1) * 512 + k * 2


def int4_stream_gemv(x: torch.Tensor, words: torch.Tensor, scale_words_: torch.Tensor, group_size: int,
                     bias: torch.Tensor | None = None, gated: bool = False, residual: torch.Tensor | None = None,
                     norm_weight: torch.Tensor | None = None, eps: float = 1e-5,
                     launch_config: tuple[int, int, int] | None = None, grid: int | None = None,
                     probe: dict[str, int] | None = None) -> torch.Tensor:
    """x (1, K) bf16 @ dequant(W).T with int4_mma.int4_mma_gemv's options (gated, residual, norm_weight, bias);
    `launch_config`: (WARPS, RING, MAXQ), stream_config's by default; `grid`: blocks (default BLOCKS_PER_SM an SM),
    at most one a 16-row tile; `probe`: extra -D settings of timing probes (bench/int4_stream_check.py)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] != 1:
        raise ValueError(f"the streaming int4 GEMV takes one token row, got {x2.shape[0]}")
    if x2.stride(-1) != 1 or x2.data_ptr() % 16:   # read in 16-byte pieces
        x2 = x2.clone(memory_format=torch.contiguous_format)
    if norm_weight is not None and norm_weight.data_ptr() % 16:
        norm_weight = norm_weight.clone()
    n_total = words.shape[0] * 16
    n = n_total // 2 if gated else n_total
    assert k % 64 == 0 and words.shape[1] == k // 64 * 128 and n % 16 == 0
    assert scale_words_.shape == (n_total, k // group_size) and scale_words_.is_contiguous()
    res = None
    if residual is not None:
        res = residual.reshape(n)
        assert res.is_contiguous() and res.dtype == torch.bfloat16
    for t in (bias, norm_weight):
        assert t is None or (t.dtype == torch.bfloat16 and t.is_contiguous())
    warps, ring, maxq = launch_config or stream_config(k, group_size, gated)
    shared = shared_bytes(warps, ring, k, gated)
    nred = 4 + 4 * gated + 2 * (norm_weight is not None)
    limit = getattr(torch.cuda.get_device_properties(x.device), "shared_memory_per_block_optin", 227 * 1024)
    if shared + 2 * nred * warps * 32 * 4 > limit:   # the ring and x, then the kernel's static reduction buffers
        raise ValueError(f"a streaming launch of {warps} warps x {ring} quads at K {k} needs {shared} bytes of shared "
                         f"memory besides its reduction buffers, more than the GPU's {limit}: give a smaller ring "
                         "(stream_config)")
    out = torch.empty(1, n, device=x.device, dtype=torch.bfloat16)
    use_pdl = pdl(x.device)
    defines = {"WARPS": warps, "RING": ring, "MAXQ": maxq, "GS": group_size // 16, "GATED": int(gated),
               "NORM": int(norm_weight is not None), "RES": int(res is not None), "BIAS": int(bias is not None),
               "PDL": int(use_pdl), **(probe or {})}
    kernel = nvrtc_launch.compiled_kernel(_source(), "int4_stream_gemv", defines, x.device)
    if grid is None:
        grid = torch.cuda.get_device_properties(x.device).multi_processor_count * BLOCKS_PER_SM
    nvrtc_launch.launch(kernel, min(n // 16, grid), warps * 32,
                        [words, scale_words_, x2, norm_weight, bias, res, out, k, n, float(eps)], x.device,
                        pdl=use_pdl, shared_bytes=shared)
    return out.reshape(*x.shape[:-1], n)
