"""Fused elementwise kernels of the inference decoder: add+RMSNorm, rotary+KV-cache write, SiLU*mul.

    normed, resid = add_rms_norm(x, resid, weight, eps)      # resid = x + resid; normed = norm(resid)
    q = rotary_kv_write(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, hq, hkv)
    act = silu_mul(gate_up)                                   # silu(gate) * up, gate_up = [gate | up]

Each op is one Triton kernel on CUDA (when Triton imported) and the same arithmetic in plain PyTorch
elsewhere. Both round where the training model's eager ops round (fourfold.models.llama: the residual
add and the rotary products in the activation dtype, the norm in float32), so greedy tokens match the
eager model up to reduction order. qkv is (T, (hq + 2 * hkv) * d): the fused q|k|v projection of
fourfold.infer.fused_decoder; the rotated keys and the values go straight to the pool's slots and only
the rotated queries come back, (T, hq, d).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fourfold.ops.triton_launch import pdl, triton

if triton is not None:
    import triton.language as tl

    from fourfold.ops.triton_launch import pdl_signal, pdl_wait

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, dim, eps,
                             HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_signal(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        x = tl.load(x_ptr + row * dim + cols, mask=mask, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(res_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32))
            x = x.to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * dim + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / dim + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * dim + cols, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def bf16_rounded(x):
        """float32 x rounded to the nearest bfloat16 (ties to even), as float32, by integer operations on its bits.
        Through a float cast instead, the compiler narrows a product of bf16 values to a bf16 multiply and fuses
        it with the add that follows into one FMA, which skips this rounding (H200, Triton 3.6: 24% of rotated
        elements 1 ulp away from torch's eager rotary)."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def rotate_rounded(x, partner, c, s):
        """x * cos + rotate_half(x) * sin for x in the activation dtype, `partner` the matching element of
        rotate_half(x) (-x2 for the first half, x1 for the second), c and s float32 values of that dtype;
        each product and the sum rounded to the activation dtype (for bf16 bit for bit as torch's eager
        x * cos + rotate_half(x) * sin; float16 and float32 products may still fuse into FMAs). Shared with
        fourfold.infer.decode_attention_gpu, so both kernels rotate bit for bit alike."""
        dt = x.dtype
        a, p = x.to(tl.float32), partner.to(tl.float32)
        if dt == tl.bfloat16:
            return (bf16_rounded(a * c) + bf16_rounded(p * s)).to(dt)
        return ((a * c).to(dt).to(tl.float32) + (p * s).to(dt).to(tl.float32)).to(dt)

    @triton.jit(do_not_specialize=["tokens"])   # one variant for every step size
    def _rotary_kv_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, k_ptr, v_ptr, tokens,
                          stride_qkv, stride_cos, stride_kslot, stride_vslot,
                          HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                          PDL: tl.constexpr):
        pdl_signal(PDL)
        pdl_wait(PDL)
        # BLOCK_T tokens of one head: heads 0..HQ-1 queries, HQ..HQ+HKV-1 keys (+ values)
        block, head = tl.program_id(0), tl.program_id(1)
        token = block * BLOCK_T + tl.arange(0, BLOCK_T)
        live = token < tokens
        half = tl.arange(0, D // 2)
        mask = live[:, None]
        pos = tl.load(pos_ptr + token, mask=live, other=0)
        base = qkv_ptr + token[:, None] * stride_qkv + head * D
        x1 = tl.load(base + half[None, :], mask=mask)
        x2 = tl.load(base + D // 2 + half[None, :], mask=mask)
        dt = x1.dtype
        table = pos[:, None] * stride_cos
        c1 = tl.load(cos_ptr + table + half[None, :], mask=mask).to(dt).to(tl.float32)
        c2 = tl.load(cos_ptr + table + D // 2 + half[None, :], mask=mask).to(dt).to(tl.float32)
        s1 = tl.load(sin_ptr + table + half[None, :], mask=mask).to(dt).to(tl.float32)
        s2 = tl.load(sin_ptr + table + D // 2 + half[None, :], mask=mask).to(dt).to(tl.float32)
        o1 = rotate_rounded(x1, -x2, c1, s1)
        o2 = rotate_rounded(x2, x1, c2, s2)
        if head < HQ:
            out = q_out_ptr + (token[:, None] * HQ + head) * D
            tl.store(out + half[None, :], o1, mask=mask)
            tl.store(out + D // 2 + half[None, :], o2, mask=mask)
        else:
            slot = tl.load(slot_ptr + token, mask=live, other=0)
            kv_head = head - HQ
            k_out = k_ptr + slot[:, None] * stride_kslot + kv_head * D
            tl.store(k_out + half[None, :], o1.to(k_ptr.dtype.element_ty), mask=mask)
            tl.store(k_out + D // 2 + half[None, :], o2.to(k_ptr.dtype.element_ty), mask=mask)
            full = tl.arange(0, D)
            v = tl.load(base + HKV * D + full[None, :], mask=mask)
            tl.store(v_ptr + slot[:, None] * stride_vslot + kv_head * D + full[None, :],
                     v.to(v_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, ffn, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_signal(PDL)
        pdl_wait(PDL)
        row, part = tl.program_id(0), tl.program_id(1)
        cols = part * BLOCK + tl.arange(0, BLOCK)
        mask = cols < ffn
        g = tl.load(gu_ptr + row * 2 * ffn + cols, mask=mask, other=0.0)
        u = tl.load(gu_ptr + row * 2 * ffn + ffn + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        tl.store(out_ptr + row * ffn + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) for x (T, dim); residual None normalises x alone."""
    if not _use_triton(x):
        summed = x if residual is None else x + residual
        wide = summed.float() if summed.dtype != torch.float64 else summed
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * weight.to(wide.dtype)).to(x.dtype), summed
    x = x.contiguous()
    rows, dim = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    _add_rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, res_out, dim, eps,
                                  HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(dim), num_warps=8,
                                  PDL=pdl(x.device), launch_pdl=pdl(x.device))
    return out, res_out


def rotary_kv_write(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """Rotate q and k of qkv (T, (hq + 2 hkv) d), write k and v at the slots of the (blocks, bs, hkv, d) pool; q (T, hq, d)."""
    tokens = qkv.shape[0]
    d = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
    flat_k, flat_v = k_cache.view(-1, n_kv_heads, d), v_cache.view(-1, n_kv_heads, d)
    if not _use_triton(qkv):
        q, k, v = qkv.view(tokens, -1, d).split([n_heads, n_kv_heads, n_kv_heads], dim=1)
        c, s = cos[positions].unsqueeze(1).to(qkv.dtype), sin[positions].unsqueeze(1).to(qkv.dtype)
        half = d // 2

        def rotate(x: torch.Tensor) -> torch.Tensor:
            return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s

        flat_k.index_copy_(0, slot_mapping, rotate(k).to(flat_k.dtype))
        flat_v.index_copy_(0, slot_mapping, v.to(flat_v.dtype))
        return rotate(q)
    assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and flat_k.stride(0) == n_kv_heads * d
    q_out = torch.empty(tokens, n_heads, d, device=qkv.device, dtype=qkv.dtype)
    block_t = rotary_tokens_per_program(tokens)
    _rotary_kv_kernel[(triton.cdiv(tokens, block_t), n_heads + n_kv_heads)](
        qkv, positions, cos, sin, slot_mapping, q_out, flat_k, flat_v, tokens, qkv.stride(0), cos.stride(0),
        flat_k.stride(0), flat_v.stride(0), HQ=n_heads, HKV=n_kv_heads, D=d, BLOCK_T=block_t,
        num_warps=ROTARY_WARPS.get(block_t, 4), PDL=pdl(qkv.device), launch_pdl=pdl(qkv.device))
    return q_out


ROTARY_TOKENS = ((8, 1), (256, 8), (None, 16))
"""(at most this many tokens, tokens a rotary program takes), first match. One program per (token, head) launched
147,000 one-warp programs at a 4096-token prefill step: 178 us a layer on an H200, against 14 us at 16 tokens a
program (4 warps); 3.1 against 1.5 us at 64 tokens (8 a program); 1.3 us either way at 8 (bench/rotary_check.py,
bench/results/2026-11-25-h200-mixed-step-graphs/)."""
ROTARY_WARPS = {1: 1}
"""Warps of a rotary program by the tokens it takes (4 for counts not listed)."""


def rotary_tokens_per_program(tokens: int) -> int:
    """How many tokens one program of the rotary kernel takes at a step of `tokens` tokens (ROTARY_TOKENS)."""
    return next(block for most, block in ROTARY_TOKENS if most is None or tokens <= most)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up (T, 2 * ffn) = [gate | up], rounded like the eager SwiGLU; (T, ffn)."""
    ffn = gate_up.shape[1] // 2
    if not _use_triton(gate_up):
        gate, up = gate_up[:, :ffn], gate_up[:, ffn:]
        return F.silu(gate) * up
    gate_up = gate_up.contiguous()
    out = torch.empty(gate_up.shape[0], ffn, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(ffn, block))](gate_up, out, ffn, BLOCK=block, num_warps=4,
                                                                   PDL=pdl(gate_up.device), launch_pdl=pdl(gate_up.device))
    return out
