"""Ring attention's block kernels on one GPU: exactness of the cp-way decomposition and time per rank vs SDPA.

    python bench/ring_block_kernels.py [--cp 2] [--seqs 32768,65536] [--kernels cudnn,flash]

Context parallel needs several GPUs end to end; the part that decides its speed, the attention blocks
each rank computes, runs here on one. For each fused block kernel this script replays what the ring does
on every rank (fourfold.parallel.ring_attention's `hop_blocks`, `merge_block`, the kernels' forward and
their backward given the final output and lse), with the K/V blocks read directly instead of passed
around the ring:
1. exactness: the merged output and the q/k/v gradients against float32 causal SDPA over the whole
   sequence (errors relative to the reference's largest magnitude, next to bf16 SDPA's own error);
2. speed: forward + backward of one rank's blocks (rank 0; every rank does the same work) against one
   cp-th of bf16 causal SDPA (cuDNN) over the whole sequence, the per-GPU attention work without CP.
Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]


def ring_blocks(kernel: str, q_local, kv_locals, rank: int, cp: int):
    """Rank `rank`'s forward over every owner's K/V, as the ring runs it: (out, lse, hops, scale).

    out (b, hkv, g, s, d) and lse (b, hkv, g, s) are grouped by kv head, as the ring keeps them.
    """
    import torch

    from fourfold.parallel.ring_attention import hop_blocks, fused_block_forward, merge_block

    b, hq, s, d = q_local.shape
    hkv = kv_locals[0][0].shape[1]
    scale = 1.0 / math.sqrt(d)
    q = q_local.reshape(b, hkv, hq // hkv, s, d)
    out = q.new_zeros(q.shape, dtype=torch.float32)
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.float32)
    hops = []
    for hop in range(cp):
        owner = (rank - hop) % cp
        rows, cols, causal = hop_blocks(rank, owner, cp, s)
        k, v = kv_locals[owner]
        block_out, block_lse, meta = fused_block_forward(kernel, q[..., rows, :], k[:, :, cols], v[:, :, cols],
                                                         causal, scale)
        merge_block(out, lse, rows, block_out.float(), block_lse.float())
        hops.append((owner, rows, cols, causal, meta))
    return out.to(q_local.dtype), lse, hops, scale


def ring_backward(kernel: str, q_local, kv_locals, dout_local, out, lse, hops, scale):
    """(dq of this rank, {owner: (dk, dv) contributions}) from the final output and lse, block by block."""
    import torch

    from fourfold.parallel.ring_attention import fused_block_backward

    b, hq, s, d = q_local.shape
    hkv = kv_locals[0][0].shape[1]
    q = q_local.reshape(b, hkv, hq // hkv, s, d)
    dout = dout_local.reshape(q.shape)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = {}
    for owner, rows, cols, causal, meta in hops:
        k, v = kv_locals[owner]
        bdq, bdk, bdv = fused_block_backward(kernel, q[..., rows, :], k[:, :, cols], v[:, :, cols], dout[..., rows, :],
                                             out[..., rows, :], lse[..., rows], meta, causal, scale)
        dq[..., rows, :] += bdq.float()
        if owner not in dkv:  # float32 accumulators, one pair per owner (allocated once, not every hop)
            dkv[owner] = (torch.zeros(k.shape, device=k.device), torch.zeros(v.shape, device=v.device))
        dk, dv = dkv[owner]
        dk[:, :, cols] += bdk.float()
        dv[:, :, cols] += bdv.float()
    return dq.reshape(q_local.shape), dkv


def check(kernel: str, args) -> dict:
    """Largest errors of the emulated ring (every rank) against float32 SDPA, and bf16 SDPA's own."""
    import torch
    import torch.nn.functional as F

    from fourfold.parallel.context import shard_sequence

    cp, seq = args.cp, args.check_seq
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape_q, shape_kv = (1, args.heads, seq, args.head_dim), (1, args.kv_heads, seq, args.head_dim)
    q, k, v = (torch.randn(s, device="cuda", generator=gen) for s in (shape_q, shape_kv, shape_kv))
    weight = torch.randn(shape_q, device="cuda", generator=gen)

    def reference(dtype):
        """Causal SDPA over the whole sequence in `dtype`: [out, dq, dk, dv] in float32."""
        leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        (out.float() * weight).sum().backward()
        return [out.detach().float()] + [t.grad.float() for t in leaves]

    exact, half = reference(torch.float32), reference(torch.bfloat16)
    local = lambda t, r: shard_sequence(t, 2, r, cp).to(torch.bfloat16).contiguous()  # noqa: E731
    kv_locals = [(local(k, r), local(v, r)) for r in range(cp)]
    outs, dqs = [], []
    dks = [torch.zeros_like(kv_locals[0][0], dtype=torch.float32) for _ in range(cp)]
    dvs = [torch.zeros_like(kv_locals[0][0], dtype=torch.float32) for _ in range(cp)]
    for r in range(cp):
        q_r = local(q, r)
        out, lse, hops, scale = ring_blocks(kernel, q_r, kv_locals, r, cp)
        dout = shard_sequence(weight, 2, r, cp).to(torch.bfloat16)
        dq, dkv = ring_backward(kernel, q_r, kv_locals, dout, out, lse, hops, scale)
        outs.append(out.reshape(q_r.shape).float())
        dqs.append(dq)
        for owner, (dk, dv) in dkv.items():
            dks[owner] += dk
            dvs[owner] += dv
    result = {}
    for i, (name, got) in enumerate(zip(("output", "dq", "dk", "dv"), (outs, dqs, dks, dvs))):
        ref = [shard_sequence(exact[i], 2, r, cp) for r in range(cp)]
        ref_half = [shard_sequence(half[i], 2, r, cp) for r in range(cp)]
        top = max(float(t.abs().max()) for t in ref)
        err = max(float((g - t).abs().max()) for g, t in zip(got, ref)) / top
        own = max(float((h - t).abs().max()) for h, t in zip(ref_half, ref)) / top
        result[name] = {"ring_err": err, "bf16_sdpa_err": own, "ratio": err / max(own, 1e-6)}
    return result


def timing(kernel: str, seq: int, args) -> dict:
    """Median ms of one rank's ring blocks (forward + backward) and of 1/cp of whole-sequence SDPA."""
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    cp = args.cp
    s = seq // cp
    gen = torch.Generator(device="cuda").manual_seed(1)
    mk = lambda h, n: torch.randn(1, h, n, args.head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    q_local = mk(args.heads, s)
    kv_locals = [(mk(args.kv_heads, s), mk(args.kv_heads, s)) for _ in range(cp)]
    dout = torch.randn_like(q_local)

    def ring_step():
        """Rank 0's blocks, forward then backward."""
        out, lse, hops, scale = ring_blocks(kernel, q_local, kv_locals, 0, cp)
        ring_backward(kernel, q_local, kv_locals, dout, out, lse, hops, scale)

    ring_ms = do_bench(ring_step, warmup=50, rep=300, return_mode="median")
    q, k, v = (mk(h, seq).requires_grad_() for h in (args.heads, args.kv_heads, args.kv_heads))
    grad = torch.randn_like(q)

    def sdpa_step():
        """Whole-sequence causal SDPA, forward then backward."""
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(grad)

    sdpa_ms = do_bench(sdpa_step, warmup=50, rep=300, return_mode="median")
    return {"kernel": kernel, "seq": seq, "cp": cp, "ring_rank_ms": ring_ms, "sdpa_share_ms": sdpa_ms / cp,
            "ratio": ring_ms / (sdpa_ms / cp)}


def main() -> None:
    """Check and time each kernel; print a table; write JSON."""
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--seqs", default="32768,65536")
    p.add_argument("--check-seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kernels", default="cudnn,flash")
    p.add_argument("--out", default="ring_block_kernels.json")
    args = p.parse_args()
    rows = []
    for kernel in args.kernels.split(","):
        try:
            errs = check(kernel, args)
            worst = max(e["ratio"] for e in errs.values())
            print(f"{kernel}: " + ", ".join(f"{n} {e['ring_err']:.2e} (bf16 SDPA {e['bf16_sdpa_err']:.2e})"
                                            for n, e in errs.items()) + f"; worst ratio {worst:.2f}", flush=True)
            for seq in (int(x) for x in args.seqs.split(",")):
                row = timing(kernel, seq, args)
                row.update(worst_error_ratio=worst, errors=errs)
                rows.append(row)
                print(f"{kernel:13s} seq {seq:6d} cp {args.cp}: ring blocks {row['ring_rank_ms']:8.2f} ms per rank, "
                      f"SDPA share {row['sdpa_share_ms']:8.2f} ms, ratio {row['ratio']:.2f}", flush=True)
        except Exception as exc:  # a kernel this GPU or torch build lacks: say so, keep going
            print(f"{kernel}: FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            rows.append({"kernel": kernel, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
