"""The rotary + KV-write kernel (fused_ops.rotary_kv_write) taking several tokens a program: the same bits as one.

Without a GPU the Triton kernel runs in the interpreter (TRITON_INTERPRET=1, set by tests/conftest.py), forced on
CPU tensors. Prefill-sized steps (many tokens, positions and pool slots scattered) run with 1, 4 and 16 tokens a
program, token counts that do not divide by them included; the rotated queries and the pool afterwards must be equal
bit for bit, and close to the plain torch arithmetic of the CPU path. float16 under the interpreter (its bfloat16
conversions are wrong, see tests/test_decode_attention_gpu.py), bfloat16 on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import DEVICE, require_triton_runtime

require_triton_runtime()
from fourfold.infer import fused_ops  # noqa: E402 - after the check above

HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def make_step(tokens: int, *, hq=4, hkv=2, d=16, slots=96, dtype=HALF, seed=0) -> dict:
    """A step's q|k|v rows, positions and distinct pool slots (shuffled), rotary tables and a random pool."""
    gen = torch.Generator().manual_seed(seed)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.outer(torch.arange(256).float(), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return dict(qkv=torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(DEVICE),
                positions=torch.randint(0, 256, (tokens,), generator=gen).to(DEVICE),
                cos=angles.cos().to(DEVICE), sin=angles.sin().to(DEVICE),
                k_cache=torch.randn(slots // 8, 8, hkv, d, generator=gen).to(dtype).to(DEVICE),
                v_cache=torch.randn(slots // 8, 8, hkv, d, generator=gen).to(dtype).to(DEVICE),
                slot_mapping=torch.randperm(slots, generator=gen)[:tokens].to(DEVICE), n_heads=hq, n_kv_heads=hkv)


def run(step: dict, monkeypatch, block_t: int | None, triton_kernel: bool = True):
    """(q, k_cache, v_cache) after rotary_kv_write on copies of the pool, `block_t` tokens a program."""
    monkeypatch.setattr(fused_ops, "_use_triton", lambda x: triton_kernel)
    if block_t is not None:
        monkeypatch.setattr(fused_ops, "ROTARY_TOKENS", ((None, block_t),))
    k, v = step["k_cache"].clone(), step["v_cache"].clone()
    q = fused_ops.rotary_kv_write(step["qkv"], step["positions"], step["cos"], step["sin"], k, v,
                                  step["slot_mapping"], step["n_heads"], step["n_kv_heads"])
    return q, k, v


@pytest.mark.parametrize("tokens", [1, 13, 64])
def test_tokens_per_program_change_no_bits(tokens, monkeypatch):
    step = make_step(tokens)
    q1, k1, v1 = run(step, monkeypatch, 1)
    assert not torch.equal(k1, step["k_cache"])  # the kernel wrote the pool
    for block_t in (4, 16):
        q, k, v = run(step, monkeypatch, block_t)
        assert torch.equal(q, q1) and torch.equal(k, k1) and torch.equal(v, v1), block_t
    q_ref, k_ref, v_ref = run(step, monkeypatch, None, triton_kernel=False)
    assert torch.equal(v1, v_ref)  # values are copied, not rotated
    tol = 2e-3 if HALF == torch.float16 else 1e-2
    torch.testing.assert_close(q1.float(), q_ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(k1.float(), k_ref.float(), rtol=tol, atol=tol)


def test_rule_takes_more_tokens_a_program_as_steps_grow():
    counts = [fused_ops.rotary_tokens_per_program(t) for t in (1, 64, 256, 257, 1024, 4096, 100_000)]
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] > 1
    assert all(c & (c - 1) == 0 for c in counts)  # Triton's aranges need powers of two
