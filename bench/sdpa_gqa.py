"""Grouped-query attention through SDPA: repeat K/V heads vs `enable_gqa=True`, timed per backend on one GPU.

    python bench/sdpa_gqa.py

Decides how `fourfold.models.llama.CausalAttentionCore` feeds SDPA: prints forward+backward time of
both ways for the 1.1B attention shape (batch 4, 32 query heads, 4 kv heads, seq 2048, head dim 64, bf16).
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def repeat_kv(q, k, v):
    """Causal SDPA with the K and V heads repeated up to the number of query heads."""
    r = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), is_causal=True)


def native_gqa(q, k, v):
    """Causal SDPA with grouped-query attention left to the kernel (`enable_gqa=True`)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def time_fn(fn, q, k, v, iters=50):
    """Milliseconds per forward+backward of `fn(q, k, v)`, after 5 warm-up calls."""
    for _ in range(5):
        fn(q, k, v).sum().backward()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(q, k, v).sum().backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    """Print both ways' time and max difference from the repeated-K/V output, per SDPA backend."""
    b, hq, hkv, s, d = 4, 32, 4, 2048, 64
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = repeat_kv(q, k, v)
    for name, fn in (("repeat_interleave", repeat_kv), ("enable_gqa", native_gqa)):
        for backend in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                ctx = sdpa_kernel([backend]) if backend else torch.enable_grad()
                with ctx:
                    err = (fn(q, k, v) - ref).abs().max().item()
                    ms = time_fn(fn, q, k, v)
                print(f"{name:18s} {str(backend or 'default'):32s} {ms:7.3f} ms fwd+bwd  max|diff| {err:.2e}")
            except RuntimeError as e:
                print(f"{name:18s} {str(backend or 'default'):32s} unavailable: {str(e).splitlines()[0][:80]}")


if __name__ == "__main__":
    main()
