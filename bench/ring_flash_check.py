"""Check ring attention's fused-kernel paths on GPUs: output and q/k/v gradients against one-device SDPA.

    torchrun --standalone --nproc-per-node 2 bench/ring_flash_check.py [--seq 8192] [--dtype bf16] [--kernel cudnn]

The CPU tests check ring attention's matmul path in float64; the fused paths (CUDA, bf16/fp16: cuDNN or
FlashAttention-2, the GPU's default unless --kernel names one) can only run here. Every rank builds the same random q, k, v for the whole sequence (grouped-query heads), computes
causal SDPA on it as the reference, then runs ring attention on its load-balanced chunks and compares its
output and gradients with the matching rows of the reference. Prints the largest errors relative to the
reference's largest magnitude, next to bf16 SDPA's own error against a float32 SDPA, and exits 1 if ring
attention's error exceeds 4x that.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]


def main() -> None:
    """Compare ring attention (fused blocks) with single-device SDPA on this rank's chunks."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from fourfold.parallel.context import shard_sequence
    from fourfold.parallel.ring_attention import FUSED_KERNELS, fused_block_kernel, ring_attention

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--kernel", choices=FUSED_KERNELS, help="the block kernel (default: the GPU's own choice)")
    args = p.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    rank, cp = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape_q, shape_kv = (1, args.heads, args.seq, args.head_dim), (1, args.kv_heads, args.seq, args.head_dim)
    q, k, v = (torch.randn(s, device="cuda", generator=gen) for s in (shape_q, shape_kv, shape_kv))
    weight = torch.randn(shape_q, device="cuda", generator=gen)

    def reference(precision):
        """Causal SDPA over the whole sequence in `precision`; returns (out, dq, dk, dv) in float32."""
        leaves = [t.detach().to(precision).clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        (out.float() * weight).sum().backward()
        return [out.float()] + [t.grad.float() for t in leaves]

    exact, half = reference(torch.float32), reference(dtype)
    local = [shard_sequence(t, 2, rank, cp).detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
    kernel = args.kernel or fused_block_kernel(local[0])
    assert kernel is not None, "no fused block kernel for this GPU and dtype"
    out = ring_attention(*local, dist.group.WORLD, rank, cp, kernel=kernel)
    (out.float() * shard_sequence(weight, 2, rank, cp)).sum().backward()
    ring = [out.float()] + [t.grad.float() for t in local]
    names = ("output", "dq", "dk", "dv")
    worst = 0.0
    for name, got, ref, ref_half in zip(names, ring, exact, half):
        ref_local, half_local = shard_sequence(ref, 2, rank, cp), shard_sequence(ref_half, 2, rank, cp)
        scale = float(ref_local.abs().max())
        err = float((got - ref_local).abs().max()) / scale
        err_sdpa = float((half_local - ref_local).abs().max()) / scale
        worst = max(worst, err / max(err_sdpa, 1e-6))
        if rank == 0:
            print(f"{name:6s} ring {args.dtype} vs fp32 SDPA {err:.2e}   ({args.dtype} SDPA vs fp32 SDPA {err_sdpa:.2e})")
    if rank == 0:
        print(f"cp={cp} seq={args.seq} kernel={kernel}: worst error ratio to {args.dtype} SDPA's own {worst:.2f} "
              f"({'OK' if worst <= 4 else 'TOO LARGE'})")
    dist.destroy_process_group()
    sys.exit(0 if worst <= 4 else 1)


if __name__ == "__main__":
    main()
