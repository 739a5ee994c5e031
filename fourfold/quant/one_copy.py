"""One run-time copy of each int4 weight on a GPU: converted linears keep only the decode kernels' words layout.

    keep_one_copy(model, device)    # before the KV pool is sized: what it frees goes to the pool

A converted linear on a GPU used to hold its weight three times, each the stored size: the stored nibbles (for
fourfold.quant.int4_gemm above the decode GEMVs' rows), fourfold.quant.int4_mma's fragment-order words (the
decode GEMVs) and, for gate|up, the one-row Triton GEMV's group planes; llama-1b's block linears took ~0.63 of their bf16
bytes instead of ~0.25. int4_gemm now reads the words too (a tile in natural order without a permute), so a
linear whose every row count has a words kernel (Int4WeightLinear.words_fit) keeps only the words (to_words).
Checkpoints still hold the stored nibbles (the module's state_dict hooks convert).

Off by default, because it costs some speed (H200, llama-1b int4-g128): the model's run-time bytes drop from 1.64
to 0.93 GiB (int4 linears 0.277 of their bf16 bytes, not 0.658; bench/results/2026-11-25-h200-int4-one-copy/), but
one sequence's decode step takes 0.542 against 0.524 ms of GPU time (the gated gate|up's one row on the tensor-core
GEMV: the Triton one needs the planes) and steps of 17-256 rows run int4_gemm on the words (decode steps of 64 rows
1.802 against 1.665 ms, one more split-K sum kernel a layer; above 64 rows the words are dequantized for cuBLAS).
End to end: 32,256 against 32,657 tok/s at 64 concurrent sequences, 46,195 against 48,495 at 128
(bench/int4_steps_gpu.py, bench/results/2026-11-25-h200-int4-two-tiles/steps64/ and steps128/). An earlier run's
24,678 against 33,155 at 64 did not come back (its two one-copy runs gave 24,678 and 27,450). Steps of 1-32 rows
other than gate|up's one row run the same tensor-core GEMV in both layouts. FOURFOLD_INT4_ONE_COPY=1 at import
turns it on.
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
