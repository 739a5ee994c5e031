"""The engine's forward on the CPU: a fourfold Llama's paged step with fused, packed weights and few ops per layer.

    decoder = CpuDecoder.from_model(model)     # None when the model cannot run this way (see can_decode)
    logits = decoder(st, pool)                 # st: StepTensors; the logits model(..., cache=PagedStep) gives

On a small model the CPU step is mostly fixed costs: 30 layers of about forty eager ops and seven oneDNN
calls each. Per layer this forward runs one q|k|v matmul and one gate|up matmul (the weights concatenated
once, and packed for oneDNN in bf16: fourfold.infer.cpu_linear), the rotary embedding of q and k together
in four ops, the pool write, attention planned once per step (fourfold.infer.cpu_attention), and the
norms on precomputed float32 weights. Every op rounds where the model's eager forward rounds (residual
adds and rotary products in the activation dtype, norms in float32), so greedy tokens match up to
reduction order. For bf16 and float32 models the small ops between the linears run as fused C kernels
(fourfold.infer.cpu_kernels: add+norm, rotary + pool write, decode attention, SiLU*up; same roundings)
when a C compiler is there; otherwise, and for float64, the torch ops below.

Weights: the model's wq/wk/wv and w1/w3 become row slices of the fused projection (views of one tensor
for plain nn.Linear; for packed bf16 linears, modules that run the fused product and slice its output),
so no weight is held twice and the model's own forward still runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fourfold.infer import cpu_kernels
from fourfold.infer.cpu_attention import CpuStepAttention
from fourfold.infer.cpu_linear import PackedLinear, packing_works
from fourfold.infer.kv_pool import KVPool
from fourfold.infer.step_tensors import StepTensors


class RowsOf(nn.Module):
    """Output features start:stop of a fused packed projection: the model's own forward through it."""

    def __init__(self, fused: PackedLinear, start: int, stop: int):
        super().__init__()
        self.fused, self.start, self.stop = fused, start, stop
        self.in_features, self.out_features = fused.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start:self.stop]


def _dense_weight(lin: nn.Module) -> torch.Tensor:
    """The (out, in) weight of an nn.Linear or a PackedLinear (unpacked from oneDNN's layout)."""
    return lin.packed.to_dense() if isinstance(lin, PackedLinear) else lin.weight.detach()


def _is_plain(lin: nn.Module) -> bool:
    return (type(lin) is nn.Linear and lin.bias is None and lin.weight.is_floating_point()
            and type(lin.weight.data) is torch.Tensor) or isinstance(lin, PackedLinear)


def can_decode(model: nn.Module) -> bool:
    """Whether `model` is a whole fourfold Llama on the CPU with bias-free float linears (plain or packed)."""
    if any(getattr(model, name, None) is None for name in ("tok_embeddings", "norm", "output", "layers")):
        return False
    if any(hasattr(p, "full_tensor") or p.device.type != "cpu" for p in model.parameters()):
        return False
    if not _is_plain(model.output):
        return False
    for block in model.layers.values():
        att, ffn = block.attention, block.feed_forward
        if not all(_is_plain(lin) for lin in (att.wq, att.wk, att.wv, att.wo, ffn.w1, ffn.w2, ffn.w3)):
            return False
    return True


def _project(lin: nn.Module):
    """x -> x W^T for a plain or packed linear, as a bound call without the nn.Module dispatch."""
    if isinstance(lin, PackedLinear):
        return lin.bound()
    weight = lin.weight
    return lambda x: F.linear(x, weight)


def _fuse(parent: nn.Module, names: list[str]):
    """One projection for parent's linears `names` stacked by output rows; the linears become slices of it."""
    linears = [getattr(parent, n) for n in names]
    weight = torch.cat([_dense_weight(lin) for lin in linears], dim=0)
    packed = any(isinstance(lin, PackedLinear) for lin in linears) and packing_works()
    row = 0
    if packed:
        fused = PackedLinear(weight)
        for name, lin in zip(names, linears):
            rows = lin.out_features
            setattr(parent, name, RowsOf(fused, row, row + rows))
            row += rows
        return fused.bound()
    for lin in linears:  # plain Linears: point each weight at its rows of the fused tensor (views)
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[row:row + rows], requires_grad=False)
        row += rows
    return lambda x: F.linear(x, weight)


class _Layer:
    """One block's projections and float32 norm weights."""

    def __init__(self, block: nn.Module):
        att, ffn = block.attention, block.feed_forward
        self.head_dim = att.head_dim
        self.n_heads = att.wq.out_features // att.head_dim
        self.n_kv_heads = att.wk.out_features // att.head_dim
        self.ffn_dim = ffn.w1.out_features
        self.qkv = _fuse(att, ["wq", "wk", "wv"])
        self.gate_up = _fuse(ffn, ["w1", "w3"])
        self.wo, self.w2 = _project(att.wo), _project(ffn.w2)
        self.attn_norm, self.ffn_norm = _norm_weight(block.attention_norm), _norm_weight(block.ffn_norm)
        self.eps = block.attention_norm.eps
        self.norm_ptrs = (self.attn_norm.data_ptr(), self.ffn_norm.data_ptr())


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    wide = torch.promote_types(norm.weight.dtype, torch.float32)
    return norm.weight.detach().to(wide)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fourfold.models.llama.RMSNorm's arithmetic: in float32 (or float64), scaled, cast back to x's dtype."""
    return F.rms_norm(x.to(weight.dtype), (x.shape[-1],), weight, eps).to(x.dtype)


class CpuDecoder:
    """A fourfold Llama's paged-step forward for the CPU (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers = [(int(name), _Layer(block)) for name, block in model.layers.items()]
        self.head = _project(model.output)
        self.final_norm, self.eps = _norm_weight(model.norm), model.norm.eps
        half = model.rope_sin.shape[1] // 2
        # rotate_half(x) * sin == swap_halves(x) * [-sin_1, sin_2], exactly (negation does not round)
        self.sin_signed = torch.cat([-model.rope_sin[:, :half], model.rope_sin[:, half:]], dim=1)
        self._pool, self._caches = None, []  # per layer (k_cache, v_cache, flat k, flat v) views of the last pool
        # fused C kernels (fourfold.infer.cpu_kernels) for bf16/float32 models, else None: the torch ops below
        fits = model.tok_embeddings.weight.dtype in cpu_kernels.SUFFIX and self.final_norm.dtype == torch.float32
        self.kernels = cpu_kernels.load() if fits else None

    def _layer_caches(self, pool: KVPool) -> list[tuple[torch.Tensor, ...]]:
        """Each layer's pool tensors and their (slots, hkv, d) views, made once per pool (not per step and layer)."""
        if self._pool is not pool:
            self._caches = []
            for layer_idx, lay in self.layers:
                k_cache, v_cache = pool.layer(layer_idx)
                hkv, d = lay.n_kv_heads, lay.head_dim
                self._caches.append((k_cache, v_cache, k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)))
            self._pool = pool
        return self._caches

    @classmethod
    def from_model(cls, model: nn.Module) -> "CpuDecoder | None":
        """A decoder over `model`'s weights (its q|k|v and gate|up fused in place); None when can_decode fails."""
        return cls(model) if can_decode(model) else None

    @torch.inference_mode()
    def __call__(self, st: StepTensors, pool: KVPool) -> torch.Tensor:
        """Logits (len(st.logits_for), vocab) in the model dtype for one step; writes the step's K/V to `pool`."""
        m = self.model
        x = m.tok_embeddings(st.tokens)  # (T, dim)
        if self.kernels is not None and x.dtype in cpu_kernels.SUFFIX and pool.keys.dtype == x.dtype:
            return self._kernel_step(st, pool, x)
        dtype, tokens = x.dtype, x.shape[0]
        cos = m.rope_cos[st.positions].to(dtype)[:, None]  # (T, 1, d), as the model's apply_rotary casts them
        sin = self.sin_signed[st.positions].to(dtype)[:, None]
        plan = CpuStepAttention(st, pool.block_size)
        residual = x
        caches = self._layer_caches(pool)
        for i, ((_, lay), (k_cache, v_cache, flat_k, flat_v)) in enumerate(zip(self.layers, caches)):
            hq, hkv, d = lay.n_heads, lay.n_kv_heads, lay.head_dim
            if i:
                residual = residual + x
            qkv = lay.qkv(_rms_norm(residual, lay.attn_norm, lay.eps))
            qk = qkv[:, :(hq + hkv) * d].view(tokens, hq + hkv, d)
            swapped = qk.view(tokens, hq + hkv, 2, d // 2).flip(2).view(tokens, hq + hkv, d)
            rotated = qk * cos
            rotated += swapped * sin
            q, k = rotated[:, :hq], rotated[:, hq:]
            v = qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
            flat_k.index_copy_(0, st.slot_mapping, k)
            flat_v.index_copy_(0, st.slot_mapping, v)
            out = plan.attend(q, k, v, k_cache, v_cache, d ** -0.5)
            residual = residual + lay.wo(out.reshape(tokens, hq * d))
            gate_up = lay.gate_up(_rms_norm(residual, lay.ffn_norm, lay.eps))
            x = lay.w2(F.silu(gate_up[:, :lay.ffn_dim]) * gate_up[:, lay.ffn_dim:])
        h = (residual + x)[st.logits_for]
        return self.head(_rms_norm(h, self.final_norm, self.eps))

    def _kernel_step(self, st: StepTensors, pool: KVPool, x: torch.Tensor) -> torch.Tensor:
        """The step with the fused C kernels between the packed linears: per layer add+norm, q|k|v, rotary + pool
        write, paged attention, wo, add+norm, gate|up, SiLU*up, w2 (the same roundings as the torch ops)."""
        m, k = self.model, self.kernels
        dtype, tokens, dim = x.dtype, x.shape[0], x.shape[1]
        add_norm, rope = k.get("ff_add_rms_norm", dtype), k.get("ff_rope_write_kv", dtype)
        attend, silu_mul = k.get("ff_paged_attention", dtype), k.get("ff_silu_mul", dtype)
        cos = m.rope_cos[st.positions].to(dtype).contiguous()
        sin = self.sin_signed[st.positions].to(dtype).contiguous()
        slots, tables = st.slot_mapping.contiguous(), st.block_tables.contiguous()
        lens, starts = st.seq_lens.contiguous(), st.query_start.contiguous()
        step_ptrs = (tables.data_ptr(), tables.shape[1], lens.data_ptr(), starts.data_ptr(), lens.shape[0])
        lay0 = self.layers[0][1]
        hq, hkv, d = lay0.n_heads, lay0.n_kv_heads, lay0.head_dim
        residual, normed = x, torch.empty_like(x)
        q, out = torch.empty(tokens, hq * d, dtype=dtype), torch.empty(tokens, hq * d, dtype=dtype)
        act = torch.empty(tokens, lay0.ffn_dim, dtype=dtype)
        rp, np_, qp, op, ap = residual.data_ptr(), normed.data_ptr(), q.data_ptr(), out.data_ptr(), act.data_ptr()
        cp, sp, slp = cos.data_ptr(), sin.data_ptr(), slots.data_ptr()
        scale, bs = d ** -0.5, pool.block_size
        # decode-only steps attend in C; steps with prompt chunks use the torch plan (SDPA is faster on those)
        plan = None if tokens == lens.shape[0] else CpuStepAttention(st, bs)
        add = None
        for (_, lay), (k_cache, v_cache, flat_k, flat_v) in zip(self.layers, self._layer_caches(pool)):
            kp, vp = k_cache.data_ptr(), v_cache.data_ptr()
            add_norm(rp, add, lay.norm_ptrs[0], np_, tokens, dim, lay.eps)
            qkv = lay.qkv(normed)
            rope(qkv.data_ptr(), tokens, hq, hkv, d, cp, sp, slp, qp, kp, vp)
            if plan is None:
                attend(qp, kp, vp, *step_ptrs, hq, hkv, d, bs, scale, op)
                o = lay.wo(out)
            else:
                o = lay.wo(plan.attend(q.view(tokens, hq, d), flat_k[slots], flat_v[slots], k_cache, v_cache, scale)
                           .reshape(tokens, hq * d))
            add_norm(rp, o.data_ptr(), lay.norm_ptrs[1], np_, tokens, dim, lay.eps)
            gate_up = lay.gate_up(normed)
            silu_mul(gate_up.data_ptr(), tokens, lay.ffn_dim, ap)
            x = lay.w2(act)
            add = x.data_ptr()
        add_norm(rp, add, self.final_norm.data_ptr(), np_, tokens, dim, self.eps)
        return self.head(normed[st.logits_for])
