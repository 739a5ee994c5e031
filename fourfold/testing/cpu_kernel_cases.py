"""Torch references for the fused CPU kernels (fourfold.infer.cpu_kernels) and random cases to run both on.

    case = kernel_case("attention", tokens=16, dtype=torch.bfloat16)   # a dict of input tensors
    want = REFERENCE["attention"](case)       # what cpu_decoder's torch ops compute
    got = FUSED["attention"](kernels, case)   # the same through the C kernel

Shared by tests/test_cpu_kernels.py (parity) and bench/cpu_kernels.py (time of each side). The references
are the torch ops of fourfold.infer.cpu_decoder's plain path, so parity here is parity with that path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fourfold.infer.cpu_attention import CpuStepAttention
from fourfold.infer.step_tensors import StepTensors

SHAPES = dict(dim=576, hq=9, hkv=3, d=64, ffn=1536, block_size=16)
"""SmolLM2-135M's sizes (the model the CPU benchmark runs); tests pass smaller ones."""


def _step(lengths: list[int], new: list[int], block_size: int, gen: torch.Generator) -> StepTensors:
    """A step of sequences with `lengths` cached tokens after it, `new` of them this step, blocks shuffled."""
    width = max(-(-n // block_size) for n in lengths)
    n_blocks = width * len(lengths) + 1
    order = torch.randperm(n_blocks - 1, generator=gen).to(torch.int32)
    tables = order[:width * len(lengths)].view(len(lengths), width).contiguous()
    starts = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    starts[1:] = torch.tensor(new).cumsum(0)
    positions = torch.cat([torch.arange(L - n, L) for L, n in zip(lengths, new)])
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(new))
    slots = tables[owner, positions // block_size].long() * block_size + positions % block_size
    return StepTensors(torch.zeros(len(positions), dtype=torch.long), positions, slots, tables,
                       torch.tensor(lengths, dtype=torch.int32), starts, starts[1:].long() - 1)


def kernel_case(kind: str, tokens: int = 1, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                lengths: list[int] | None = None, new: list[int] | None = None, **shapes) -> dict:
    """Random inputs for kernel `kind` ("add_rms_norm", "rope_write_kv", "attention", "silu_mul").

    Set case["in_place"] = True to have both sides write the pool itself rather than a copy (for timing)."""
    s = {**SHAPES, **shapes}
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    if kind == "add_rms_norm":
        return dict(residual=rand(tokens, s["dim"]), add=rand(tokens, s["dim"]),
                    weight=torch.rand(s["dim"], generator=gen) + 0.5, eps=1e-5)
    if kind == "silu_mul":
        return dict(gate_up=rand(tokens, 2 * s["ffn"], scale=3.0))
    hq, hkv, d, bs = s["hq"], s["hkv"], s["d"], s["block_size"]
    lengths = lengths or [40 + 7 * i for i in range(tokens)]
    new = new or [1] * len(lengths)
    st = _step(lengths, new, bs, gen)
    n_blocks = int(st.block_tables.max()) + 2
    pool_k, pool_v = rand(n_blocks, bs, hkv, d), rand(n_blocks, bs, hkv, d)
    rows = int(st.query_start[-1])
    if kind == "rope_write_kv":
        angles = st.positions[:, None].float() * torch.rand(d // 2, generator=gen)[None]
        cos, sin = torch.cat([angles.cos()] * 2, 1).to(dtype), torch.cat([angles.sin()] * 2, 1)
        sin_signed = torch.cat([-sin[:, :d // 2], sin[:, d // 2:]], 1).to(dtype)
        return dict(qkv=rand(rows, (hq + 2 * hkv) * d), cos=cos, sin_signed=sin_signed, st=st, hq=hq, hkv=hkv, d=d,
                    k_cache=pool_k, v_cache=pool_v)
    if kind == "attention":
        return dict(q=rand(rows, hq, d), st=st, k_cache=pool_k, v_cache=pool_v, scale=d ** -0.5)
    raise ValueError(kind)


def _ref_add_rms_norm(c: dict) -> tuple[torch.Tensor, ...]:
    residual = c["residual"] + c["add"]
    out = F.rms_norm(residual.to(c["weight"].dtype), (residual.shape[-1],), c["weight"], c["eps"]).to(residual.dtype)
    return residual, out


def _ref_rope_write_kv(c: dict) -> tuple[torch.Tensor, ...]:
    qkv, hq, hkv, d, st = c["qkv"], c["hq"], c["hkv"], c["d"], c["st"]
    t = qkv.shape[0]
    qk = qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)
    swapped = qk.view(t, hq + hkv, 2, d // 2).flip(2).view(t, hq + hkv, d)
    rotated = qk * c["cos"][:, None]
    rotated += swapped * c["sin_signed"][:, None]
    k_cache, v_cache = (c["k_cache"], c["v_cache"]) if c.get("in_place") else (c["k_cache"].clone(), c["v_cache"].clone())
    k_cache.view(-1, hkv, d).index_copy_(0, st.slot_mapping, rotated[:, hq:])
    v_cache.view(-1, hkv, d).index_copy_(0, st.slot_mapping, qkv[:, (hq + hkv) * d:].view(t, hkv, d))
    return rotated[:, :hq].contiguous(), k_cache, v_cache


def _ref_attention(c: dict) -> tuple[torch.Tensor, ...]:
    q, st, kc, vc = c["q"], c["st"], c["k_cache"], c["v_cache"]
    hkv, d = kc.shape[2], kc.shape[3]
    rows = kc.view(-1, hkv, d)
    k, v = rows[st.slot_mapping], c["v_cache"].view(-1, hkv, d)[st.slot_mapping]
    return (CpuStepAttention(st, kc.shape[1]).attend(q, k, v, kc, vc, c["scale"]),)


def _ref_silu_mul(c: dict) -> tuple[torch.Tensor, ...]:
    gate, up = c["gate_up"].chunk(2, dim=-1)
    return (F.silu(gate) * up,)


REFERENCE = {"add_rms_norm": _ref_add_rms_norm, "rope_write_kv": _ref_rope_write_kv, "attention": _ref_attention,
             "silu_mul": _ref_silu_mul}
"""kind -> the torch ops cpu_decoder runs without the kernels; returns the outputs (and updated inputs)."""


def _fused_add_rms_norm(k, c: dict) -> tuple[torch.Tensor, ...]:
    residual, out = c["residual"].clone(), torch.empty_like(c["residual"])
    k.add_rms_norm(residual, c["add"], c["weight"], out, c["eps"])
    return residual, out


def _fused_rope_write_kv(k, c: dict) -> tuple[torch.Tensor, ...]:
    qkv, hq, hkv, d = c["qkv"], c["hq"], c["hkv"], c["d"]
    q = torch.empty(qkv.shape[0], hq, d, dtype=qkv.dtype)
    k_cache, v_cache = (c["k_cache"], c["v_cache"]) if c.get("in_place") else (c["k_cache"].clone(), c["v_cache"].clone())
    k.rope_write_kv(qkv, hq, hkv, d, c["cos"], c["sin_signed"], c["st"].slot_mapping, q, k_cache, v_cache)
    return q, k_cache, v_cache


def _fused_attention(k, c: dict) -> tuple[torch.Tensor, ...]:
    st, out = c["st"], torch.empty_like(c["q"])
    k.paged_attention(c["q"], c["k_cache"], c["v_cache"], st.block_tables, st.seq_lens, st.query_start,
                      c["k_cache"].shape[1], c["scale"], out)
    return (out,)


def _fused_silu_mul(k, c: dict) -> tuple[torch.Tensor, ...]:
    gu = c["gate_up"]
    out = torch.empty(gu.shape[0], gu.shape[1] // 2, dtype=gu.dtype)
    k.silu_mul(gu, out)
    return (out,)


FUSED = {"add_rms_norm": _fused_add_rms_norm, "rope_write_kv": _fused_rope_write_kv, "attention": _fused_attention,
         "silu_mul": _fused_silu_mul}
"""kind -> the same computation through the C kernels `k` (a fourfold.infer.cpu_kernels.Kernels)."""
