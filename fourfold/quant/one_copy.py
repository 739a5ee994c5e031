"""One run-time copy of each int4 weight on a GPU: converted linears keep only the decode kernels' words layout.

    keep_one_copy(model, device)    # before the KV pool is sized: what it frees goes to the pool

A converted linear on a GPU used to hold its weight three times, each the stored size: the stored nibbles (for
fourfold.quant.int4_gemm at 7+ token rows), fourfold.quant.int4_mma's fragment-order words (the decode GEMVs)
and, for gate|up, the one-row Triton GEMV's group planes; llama-1b's block linears took ~0.63 of their bf16
bytes instead of ~0.25. int4_gemm now reads the words too (a tile in natural order without a permute), so a
linear whose every row count has a words kernel (Int4WeightLinear.words_fit) keeps only the words (to_words).
Checkpoints still hold the stored nibbles (the module's state_dict hooks convert).

Off by default, because it costs speed (H200, llama-1b int4-g128, bench/results/2026-11-25-h200-int4-one-copy/):
the model's run-time bytes drop from 1.64 to 0.93 GiB (int4 linears 0.277 of their bf16 bytes, not 0.658), but one
sequence steps in 0.536 against 0.514 ms (the gated gate|up's one row on the tensor-core GEMV: the Triton one
needs the planes), at 128 concurrent sequences 40,781 against 45,725 tok/s (above 64 rows the words are
dequantized for cuBLAS) and at 64 concurrent 24,678 against 33,155, a gap the GEMM alone does not explain (within
10% of the stored layout's there) and whose cause was not found. FOURFOLD_INT4_ONE_COPY=1 at import turns it on.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from fourfold.quant.packing import Int4WeightLinear

ENABLED = os.environ.get("FOURFOLD_INT4_ONE_COPY") == "1"


def keep_one_copy(model: nn.Module, device: torch.device) -> int:
    """Converts `model`'s int4 linears to the words layout where they fit `device`: all of the transformer blocks'
    or none of them (fused q|k|v and gate|up need one layout), other linears (an int4 head) each on its own.
    Returns how many were converted; 0 when disabled or off CUDA."""
    if not ENABLED or device.type != "cuda":
        return 0
    blocks, others = [], []
    for name, m in model.named_modules():
        if isinstance(m, Int4WeightLinear):
            (blocks if ".layers." in f".{name}" else others).append(m)
    chosen = [m for m in others if m.words_fit(device)]
    if blocks and all(m.words_fit(device) for m in blocks):
        chosen += blocks
    for module in chosen:
        module.to_words()
    return len(chosen)
