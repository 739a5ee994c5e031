"""Greedy token ids on the GPU: each row's first maximum in one Triton program per row.

    ids = argmax_rows(logits)        # (R, V) float logits on CUDA -> (R,) int64, the index torch.argmax gives

Why not torch.argmax: at decode batch sizes its reduction runs a few long serial chains per row, and the
greedy pick sits on the critical path of every step (inside the decode CUDA graph, right after the output
head). Here a program loads its row in chunks of up to CHUNK values (one chunk for a 32k vocabulary), takes
the chunk's maximum and its first index with Triton's tree reductions, and keeps the best chunk, the earlier
one on ties. Values compare in float32 (every bf16/fp16 logit is exact there), so the index equals
torch.argmax's on the same tensor for every input without NaN. Launched with programmatic dependent launch
where fourfold.ops.triton_launch turns it on. bench/argmax_check.py times it against torch.argmax.
"""

from __future__ import annotations

import torch

from fourfold.ops.triton_launch import pdl, triton

CHUNK = 32768
"""Most logits a program holds at once (16 warps: 64 a thread)."""


def available(logits: torch.Tensor) -> bool:
    """Whether `argmax_rows` runs for these logits: Triton imported, a CUDA tensor of 2 dims, unit column stride."""
    return triton is not None and logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1


if triton is not None:
    import triton.language as tl

    from fourfold.ops.triton_launch import pdl_signal, pdl_wait

    @triton.jit
    def _argmax_rows_kernel(x_ptr, out_ptr, vocab, stride_row, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_signal(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        best = tl.full((), float("-inf"), tl.float32)
        best_index = tl.full((), 0, tl.int64)
        for start in range(0, vocab, BLOCK):
            x = tl.load(x_ptr + row * stride_row + start + cols, mask=start + cols < vocab,
                        other=float("-inf")).to(tl.float32)
            chunk_best = tl.max(x, axis=0)
            chunk_index = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + start
            take = chunk_best > best
            best_index = tl.where(take, chunk_index, best_index)
            best = tl.where(take, chunk_best, best)
        tl.store(out_ptr + row, best_index)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """(R,) int64: the index of each row's first maximum (`available(logits)` must hold)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    use_pdl = pdl(logits.device)
    block = min(CHUNK, triton.next_power_of_2(vocab))
    _argmax_rows_kernel[(rows,)](logits, out, vocab, logits.stride(0), BLOCK=block, PDL=use_pdl,
                                 num_warps=16 if block >= 8192 else 4, launch_pdl=use_pdl)
    return out
