"""Ring attention: exact causal attention over a sequence whose load-balanced chunks live on the cp ranks.

    out = ring_attention(q, k, v, group, cp_rank, cp)   # q (b, hq, s_local, d), k/v (b, hkv, s_local, d)

Each rank holds global chunks (r, 2cp-1-r) of every sequence (see fourfold/parallel/context.py). The
K/V blocks travel around the ring (rank r sends to r+1), cp-1 hops; at hop t rank r holds the block of
owner (r - t) mod cp and attends its queries to it. Which query/key pairs the causal mask keeps depends
only on the two ranks involved (`hop_blocks`):

    owner == r   local queries vs local keys, causal (the two chunks are in increasing global order)
    owner <  r   all local queries vs the owner's first chunk, no mask (that chunk precedes both of ours)
    owner >  r   our second chunk vs all the owner's keys, no mask (our first chunk precedes both of theirs)

so every hop does the same work on every rank and nothing is masked out but the diagonal block.
Partial results are merged exactly by their log-sum-exp (online softmax), kept in at least float32.

The backward is an autograd Function of its own: it recomputes each block's probabilities from the
saved final log-sum-exp (the flash-attention recipe), keeps dQ local, and sends the K/V blocks around
the ring again together with their dK/dV accumulators, which arrive back at their owner after cp hops.
Every hop's send/receive is posted before the hop's compute, so communication overlaps computation.

Block kernels, the same algorithm around them:
- CUDA with bf16/fp16 inputs: a fused attention kernel behind torch's SDPA gives each block's output and
  log-sum-exp without materialising the (s/cp)^2 score matrix; its backward is handed the *final* output
  and lse, so it computes the block's share of the full gradient. Both take grouped-query K/V as they are.
  On Hopper and later it is cuDNN's (`aten._scaled_dot_product_cudnn_attention`, what SDPA itself picks
  there): on an H200 one rank's blocks take 1.01-1.05x its share of whole-sequence SDPA, where
  FlashAttention-2 (`aten._scaled_dot_product_flash_attention`, the choice on Ampere) takes 1.5x
  (bench/ring_block_kernels.py).
- everything else (CPU, float32/float64): plain matmul + softmax, one score block per hop, so the gloo
  tests can check it in float64 (the fused paths need a GPU: bench/ring_block_kernels.py checks them on
  one, bench/ring_flash_check.py end to end on several).
The loop has no host synchronisation (`.item()`).
"""

from __future__ import annotations

import math

import torch

from fourfold.parallel.comm import send_recv_next


def hop_blocks(cp_rank: int, owner: int, cp: int, local_len: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal) of the attention between rank `cp_rank`'s queries and `owner`'s keys.

    `local_len` is the local sequence length (two chunks). Rows outside the returned slices see none of
    the other rank's keys; `causal` means the block is square and lower-triangular.
    """
    half = local_len // 2
    if owner == cp_rank:
        return slice(0, local_len), slice(0, local_len), True
    if owner < cp_rank:
        return slice(0, local_len), slice(0, half), False
    return slice(half, local_len), slice(0, local_len), False


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: float32 for half types, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """q (b, hkv, g, sq, d) against k (b, hkv, sk, d): scaled scores (b, hkv, g, sq, sk), causally masked."""
    scores = (q @ k.unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention: (output (b, hkv, g, sq, d), log-sum-exp (b, hkv, g, sq)), all in q's dtype.

    A causal block is square, so every row sees at least its diagonal key and the lse stays finite.
    """
    scores = _scores(q, k, causal, scale)
    lse = scores.logsumexp(dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return probs @ v.unsqueeze(2), lse


def block_backward(q, k, v, dout, lse, delta, causal: bool, scale: float):
    """Gradients (dq, dk, dv) of one block, given the *final* lse and delta = rowsum(dout * out) of q's rows.

    With the final lse the recomputed probabilities are the block's share of the full softmax, so the
    block gradients add up to the gradient of the whole attention.
    """
    probs = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    dv = (probs.transpose(-1, -2) @ dout).sum(dim=2)
    dprobs = dout @ v.unsqueeze(2).transpose(-1, -2)
    dscores = probs * (dprobs - delta.unsqueeze(-1))
    dq = (dscores @ k.unsqueeze(2)) * scale
    dk = (dscores.transpose(-1, -2) @ q).sum(dim=2) * scale
    return dq, dk, dv


FUSED_KERNELS = ("cudnn", "flash")


def fused_block_kernel(q: torch.Tensor) -> str | None:
    """The fused kernel the blocks run on for these inputs, or None for the matmul blocks.

    cuDNN's attention on Hopper and later (head_dim <= 128), FlashAttention-2 on other sm80+ GPUs
    (head_dim <= 256); both take grouped-query K/V as they are. fp16/bf16 only.
    """
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return None
    major = torch.cuda.get_device_capability(q.device)[0]
    if major >= 9 and q.shape[-1] <= 128 and torch.backends.cudnn.is_available():
        return "cudnn"
    return "flash" if major >= 8 and q.shape[-1] <= 256 else None


def fused_block_forward(kernel: str, q, k, v, causal: bool, scale: float):
    """One block on a fused kernel: (output (b, hkv, g, sq, d) in q's dtype, lse float32 (b, hkv, g, sq), meta).

    `meta` is what the kernel's backward needs besides the tensors (sequence offsets, lengths, rng state).
    """
    b, hkv, g, sq, d = q.shape
    q_flat = q.reshape(b, hkv * g, sq, d)
    if kernel == "cudnn":  # dense inputs: the ring hands it row slices, and cuDNN is strict about layouts
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q_flat.contiguous(), k.contiguous(), v.contiguous(),
                                                                   None, True, 0.0, causal, False, scale=scale)
        meta = (res[2], res[3], res[4], res[5], res[6], res[7])  # cum_q, cum_k, max_q, max_k, seed, offset
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention(q_flat, k, v, 0.0, causal, False, scale=scale)
        meta = tuple(res[2:8])  # cum_q, cum_k, max_q, max_k, rng_state, unused
    return res[0].reshape(b, hkv, g, sq, d), res[1].reshape(b, hkv, g, sq), meta


def fused_block_backward(kernel: str, q, k, v, dout, out, lse, meta, causal: bool, scale: float):
    """(dq (b, hkv, g, sq, d), dk, dv (b, hkv, sk, d)) of one block, given the final output and lse of q's rows."""
    b, hkv, g, sq, d = q.shape
    flat = (b, hkv * g, sq, d)
    dout_f, q_f, out_f = dout.reshape(flat), q.reshape(flat), out.reshape(flat)
    if kernel == "cudnn":
        cum_q, cum_k, max_q, max_k, seed, offset = meta
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout_f.contiguous(), q_f.contiguous(), k.contiguous(), v.contiguous(), out_f.contiguous(),
            lse.reshape(b, hkv * g, sq, 1).contiguous(), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal,
            scale=scale)
        return dq.reshape(q.shape), dk, dv
    cum_q, cum_k, max_q, max_k, rng_state, unused = meta
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout_f, q_f, k, v, out_f, lse.reshape(b, hkv * g, sq).contiguous(), cum_q, cum_k, max_q, max_k, 0.0,
        causal, rng_state, unused, scale=scale)
    return dq.reshape(q.shape), dk, dv


def merge_block(out, lse, rows: slice, block_out, block_lse) -> None:
    """Fold one block's (output, lse) into the running result for query `rows`, in place (online softmax)."""
    old_out, old_lse = out[..., rows, :], lse[..., rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    out[..., rows, :] = (old_out * torch.exp(old_lse - new_lse).unsqueeze(-1)
                         + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse[..., rows] = new_lse


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, cp_rank: int, cp: int, kernel: str | None):
        """Attention output (b, hq, s, d) of the local queries over every rank's K/V blocks, merged by log-sum-exp."""
        b, hq, s, d = q.shape
        hkv = k.shape[1]
        wide = wide_dtype(q.dtype)
        scale = 1.0 / math.sqrt(d)
        kernel = kernel or fused_block_kernel(q) or "matmul"
        fused = kernel != "matmul"
        q_grouped = q.reshape(b, hkv, hq // hkv, s, d)  # query heads grouped under their kv head
        q_in = q_grouped if fused else q_grouped.to(wide)
        out = q_grouped.new_zeros(q_grouped.shape, dtype=wide)
        lse = q_grouped.new_full(q_grouped.shape[:-1], float("-inf"), dtype=wide)
        metas = []
        k_cur, v_cur = k, v
        for hop in range(cp):
            # Post the next hop's exchange first so it travels while this block is computed.
            pending = send_recv_next([k_cur, v_cur], group, async_op=True) if hop + 1 < cp else None
            rows, cols, causal = hop_blocks(cp_rank, (cp_rank - hop) % cp, cp, s)
            if fused:
                block_out, block_lse, meta = fused_block_forward(kernel, q_in[..., rows, :], k_cur[:, :, cols],
                                                                 v_cur[:, :, cols], causal, scale)
                metas.append(meta)
            else:
                block_out, block_lse = block_forward(q_in[..., rows, :], k_cur[:, :, cols].to(wide),
                                                     v_cur[:, :, cols].to(wide), causal, scale)
            merge_block(out, lse, rows, block_out.to(wide), block_lse.to(wide))
            if pending is not None:
                k_cur, v_cur = pending.wait()
        if fused:
            out = out.to(q.dtype)  # the fused backward takes the output in the inputs' dtype
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.cp_rank, ctx.cp, ctx.scale, ctx.metas, ctx.kernel = group, cp_rank, cp, scale, metas, kernel
        return out.reshape(b, hq, s, d).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        """Gradients of the local q, k, v; dK/dV travel around the ring with their blocks and return to the owner."""
        q, k, v, out, lse = ctx.saved_tensors
        group, cp_rank, cp, scale = ctx.group, ctx.cp_rank, ctx.cp, ctx.scale
        fused = ctx.kernel != "matmul"
        wide = lse.dtype
        if fused:
            q_in, dout = q.reshape(out.shape), dout.reshape(out.shape).to(q.dtype)
        else:
            q_in, dout = q.reshape(out.shape).to(wide), dout.reshape(out.shape).to(wide)
            delta = (dout * out).sum(dim=-1)
        dq = torch.zeros(out.shape, dtype=wide, device=out.device)
        k_cur, v_cur = k, v
        dkv_pending = None
        for hop in range(cp):
            kv_pending = send_recv_next([k_cur, v_cur], group, async_op=True) if hop + 1 < cp else None
            rows, cols, causal = hop_blocks(cp_rank, (cp_rank - hop) % cp, cp, q.shape[2])
            if fused:
                block_dq, block_dk, block_dv = fused_block_backward(
                    ctx.kernel, q_in[..., rows, :], k_cur[:, :, cols], v_cur[:, :, cols], dout[..., rows, :],
                    out[..., rows, :], lse[..., rows], ctx.metas[hop], causal, scale)
            else:
                block_dq, block_dk, block_dv = block_backward(
                    q_in[..., rows, :], k_cur[:, :, cols].to(wide), v_cur[:, :, cols].to(wide),
                    dout[..., rows, :], lse[..., rows], delta[..., rows], causal, scale)
            dq[..., rows, :] += block_dq
            # The accumulators for this owner's K/V come from the previous rank (its previous hop).
            if dkv_pending is None:
                dk_acc, dv_acc = k.new_zeros(k.shape, dtype=wide), v.new_zeros(v.shape, dtype=wide)
            else:
                dk_acc, dv_acc = dkv_pending.wait()
            dk_acc[:, :, cols] += block_dk
            dv_acc[:, :, cols] += block_dv
            # Fresh tensors each hop: the ones sent stay untouched while in flight.
            dkv_pending = send_recv_next([dk_acc, dv_acc], group, async_op=True)
            if kv_pending is not None:
                k_cur, v_cur = kv_pending.wait()
        dk, dv = dkv_pending.wait()  # after cp hops every accumulator is back at its owner
        return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, cp_rank: int, cp: int,
                   kernel: str | None = None) -> torch.Tensor:
    """Exact causal attention of this rank's q (b, hq, s, d) over the whole sequence split across `group`.

    k and v are (b, hkv, s, d) with hq a multiple of hkv (grouped-query attention: query head h uses kv
    head h // (hq / hkv)). `cp_rank` and `cp` are this rank's index in and the size of `group`. `kernel`
    forces the block kernel ("matmul" or one of FUSED_KERNELS); by default `fused_block_kernel` picks.
    """
    if kernel is not None and kernel not in ("matmul", *FUSED_KERNELS):
        raise ValueError(f"ring attention kernel '{kernel}' is not one of matmul, {', '.join(FUSED_KERNELS)}")
    if q.shape[1] % k.shape[1] or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"ring attention needs q (b, hq, s, d) and k, v (b, hkv, s, d) with hkv dividing hq; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] % 2:
        raise ValueError(f"the local sequence ({q.shape[2]}) must hold two equal chunks")
    return _RingAttention.apply(q, k, v, group, cp_rank, cp, kernel)
