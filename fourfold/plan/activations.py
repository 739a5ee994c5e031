"""Activation memory model: the bytes autograd keeps for backward per block, loss and pipeline schedule.

Activations per transformer block, derived from the ops in `fourfold/models/llama.py` and checked against
`fourfold.recompute.saved_activation_bytes` (T = micro_batch * seq / cp tokens, Tn = T / tp under sequence
parallel else T; d = dim, f = ffn_dim / tp, q = n_heads * head_dim / tp, k = n_kv_heads * head_dim / tp;
a = bytes of a linear output (the autocast dtype, else the parameter dtype), r = bytes of the residual
stream (promote(embedding dtype, linear dtype): fp32 under bf16 autocast), n = bytes of RMSNorm's compute
dtype (at least fp32)):

| tensor kept for backward | none | selective | full |
|---|---|---|---|
| block input (residual stream, Tn x d x r) | when r = n (RMSNorm saves it) | kept by the checkpoint | kept by the checkpoint |
| RMSNorm x2: rsqrt (Tn x n) and normalised x (Tn x d x n); a fp32 copy of x when r != n | yes | recomputed | recomputed |
| norm output as linear input (T x d x r), or under autocast one cast copy per linear (3 for q/k/v, 2 for w1/w3: T x d x a each) | yes | recomputed | recomputed |
| autocast copies of the block's weights (a bytes per weight element) | yes | recomputed (one block's copies at a time: workspace; the autocast weight cache is off) | same |
| rotary: q and k after rotation (T x (q + k) x a); the cos/sin casts under autocast (4 x s x head_dim x a) | yes | recomputed | recomputed |
| v (T x k x a) | yes | yes (a matmul output) | recomputed |
| q and k before rotation (T x (q + k) x a) | no | yes (matmul outputs) | recomputed |
| attention output (T x q x a) + log-sum-exp (b x heads x s, fp32) | yes | yes | recomputed |
| wo and w2 outputs (T x d x a each) | no | yes | recomputed |
| residual after attention (Tn x d x r) | when r = n | recomputed | recomputed |
| MLP: w1 and w3 outputs, silu(w1 x), their product (4 x T x f x a) | yes | w1, w3 outputs only | recomputed |
| block output (next block's input) | counted as the next block's input | | |

`every-N` recomputes blocks 0, N, 2N, ... in full and keeps everything for the others, so every-2 keeps
about half of none. Whether selective keeps more or less than that depends on the precision, because the
selective policy of `fourfold.recompute` keeps every matmul and attention output:
- fp32 / fp64 (no autocast): per block, with its input, none keeps (6d + 2q + 2k + 4f) x T x a, selective
  (3d + 2q + 2k + 2f) x T x a and every-2 on average (3.5d + q + k + 2f) x T x a; selective exceeds every-2
  by (q + k - d/2) x T x a, which is k + d/2 > 0 without tp, so none > selective > every-2 > full.
- bf16 / fp16 autocast: a plain block also keeps the fp32 residual and norm tensors, five bf16 casts of the
  norm outputs and the bf16 weight copies, none of which selective keeps, so selective drops below half:
  none > every-2 > selective > full (the tests check both orders, measured and predicted).

The attention kernel decides what attention keeps:
- CPU (`_scaled_dot_product_flash_attention_for_cpu`) and CUDA flash attention (bf16/fp16; cuDNN keeps the
  same): q, k, v, the output (in the (b, s, h, d) layout, so wo reads it without a copy) and a (b, h, s)
  log-sum-exp in fp32. The two agree byte for byte except for flash's two 8-byte RNG scalars per call.
- CUDA in fp32: flash has no fp32 kernel, so SDPA picks memory-efficient attention, whose log-sum-exp is
  padded to a multiple of 32 positions (modelled; a torch whose efficient kernel lacks grouped-query support
  falls back to the math kernel, which stores the (b, h, s, s) probabilities).
- CUDA in fp64: the math kernel (modelled, approximately).
- Context parallel: ring attention keeps q, k, v, a wide (fp32) output and log-sum-exp and wo's input copy;
  all-gather attention keeps the gathered K and V (modelled, not measured).

Compiled cross-entropy (compute.compile without loss_chunk): keeps the logits and a log-sum-exp per token
(modelled). Compiled blocks (compute.compile) keep what inductor's partitioner saves, which is less than
eager: `_compiled_block` lists it; quant.float8 keeps float8 copies of the linears' inputs and weights there
(modelled for compiled blocks, where every recorded float8 run is). Not modelled: the CUDA caching
allocator's fragmentation and the CUDA/NCCL context itself (`fourfold.plan.predict` adds both to decide
whether a layout fits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fourfold.config import Config
from fourfold.layout import grad_accumulation_steps
from fourfold.parallel.fsdp import fsdp_dtypes
from fourfold.parallel.pipeline.schedules import SCHEDULES
from fourfold.plan.layout import ParamShape
from fourfold.precision import PrecisionPolicy, master_dtype
from fourfold.recompute import recomputed_blocks


def dtype_size(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype`."""
    return torch.empty((), dtype=dtype).element_size()


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """RMSNorm's and the loss's compute dtype: float32 for half types, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def autocast_dtype(cfg: Config) -> torch.dtype | None:
    """The autocast dtype of compute.precision (fourfold.precision.PrecisionPolicy's), or None."""
    return PrecisionPolicy.from_config(cfg, torch.device(device_type(cfg))).autocast_dtype


def device_type(cfg: Config) -> str:
    """'cpu' or 'cuda', resolving compute.device = auto the way fourfold.distributed.pick_device does."""
    if cfg.compute.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.compute.device


@dataclass(frozen=True)
class Shapes:
    """Everything the activation formulas need, resolved for one rank."""

    b: int           # micro-batch sequences
    s: int           # positions per rank (seq / cp)
    s_full: int      # positions of the whole sequence
    tn: int          # tokens in the norm / residual region (T / tp under sequence parallel)
    d: int
    hd: int
    hq: int          # query heads on this rank
    hkv: int         # kv heads on this rank
    f: int           # MLP hidden units on this rank
    v: int           # vocabulary columns on this rank
    master: torch.dtype
    compute: torch.dtype   # parameters as forward sees them
    linear: torch.dtype    # linear outputs
    autocast: torch.dtype | None
    kernel: str            # attention kernel: cpu, flash, efficient, math, ring, allgather
    gathered: bool         # sequence parallel: linear inputs are all-gathered from Tn to T tokens
    compiled: bool = False  # compute.compile: inductor's partitioner decides what each block keeps
    float8: bool = False    # quant.float8: block linears keep float8 (1-byte) copies of their inputs and weights

    @property
    def t(self) -> int:
        return self.b * self.s


def _norm(sh: Shapes, x_dtype: torch.dtype) -> int:
    """RMSNorm's saved tensors besides its input: rsqrt, the normalised x, and the fp32 copies it makes."""
    n = wide_dtype(x_dtype)
    out = sh.tn * dtype_size(n) + sh.tn * sh.d * dtype_size(n)
    if x_dtype != n:
        out += sh.tn * sh.d * dtype_size(n)  # x.to(fp32) is what pow and the multiply keep
    if sh.compute != n:
        out += sh.d * dtype_size(n)  # weight.to(fp32)
    return out


def _linear_inputs(sh: Shapes, x_dtype: torch.dtype, n_linears: int) -> int:
    """What the linears reading one norm output keep of it: the tensor once, or one autocast copy each."""
    if sh.autocast is not None and x_dtype != sh.autocast:
        return n_linears * sh.t * sh.d * dtype_size(sh.autocast)
    return sh.t * sh.d * dtype_size(x_dtype)


def _attention(sh: Shapes, keep_inputs: bool) -> int:
    """Bytes the attention kernel keeps: q, k, v (when `keep_inputs`), the output and its statistics."""
    a, t = dtype_size(sh.linear), sh.t
    wide = dtype_size(wide_dtype(sh.linear))
    qkv = t * (sh.hq + 2 * sh.hkv) * sh.hd * a if keep_inputs else 0
    out = t * sh.hq * sh.hd * a
    if sh.kernel in ("cpu", "flash"):
        return qkv + out + sh.b * sh.hq * sh.s * wide
    if sh.kernel == "efficient":
        return qkv + out + sh.b * sh.hq * (-(-sh.s // 32) * 32) * 4
    if sh.kernel == "ring":
        # fp32 accumulator output and lse kept by the autograd function, plus wo's copy of the output
        return qkv + t * sh.hq * sh.hd * wide + sh.b * sh.hq * sh.s * wide + out
    if sh.kernel == "allgather":
        gathered_kv = 2 * sh.b * sh.hkv * sh.s_full * sh.hd * a if keep_inputs else 0
        q = t * sh.hq * sh.hd * a if keep_inputs else 0
        return q + gathered_kv + 2 * out + sh.b * sh.hq * sh.s * wide
    # math: expanded K and V, the (s x s) probabilities, and the output copied for wo
    expand = 2 * t * sh.hq * sh.hd * a if sh.hq != sh.hkv else 0
    return qkv + expand + sh.b * sh.hq * sh.s * sh.s * a + 2 * out


def _compiled_block(sh: Shapes, mode: str, x_dtype: torch.dtype, weight_elems: int) -> int:
    """What a compiled block keeps (inductor's min-cut partitioner recomputes the element-wise work).

    none: both rsqrt statistics, the two norm outputs as the linears read them, q/k (rotated) and v, the
    attention output and log-sum-exp, the w1 and w3 outputs, the SwiGLU product (w2's input) and the residual
    after attention, and the block's weights as its matmuls read them (the autocast copies; float8 copies under
    float8). selective: q, k, v, the attention output and log-sum-exp, the w1 and w3 outputs, the weights.
    float8 (none): the linears' inputs kept once in float8 (1 byte), the attention tensors, the statistics and
    the residual; the partitioner does not count torch._scaled_mm as a matmul it must not repeat, so it
    recomputes the w1 and w3 outputs from their float8 inputs instead of keeping them. Derived from the graph,
    checked against the recorded H200 peaks (docs/planner.md)."""
    a, t = dtype_size(sh.linear), sh.t
    qkv = t * (sh.hq + 2 * sh.hkv) * sh.hd * a
    attn = t * sh.hq * sh.hd * a + sh.b * sh.hq * sh.s * 4
    swiglu = 2 * t * sh.f * a
    cast = sh.autocast is not None and sh.compute != sh.autocast  # weights cast to the autocast dtype
    weights = weight_elems if sh.float8 else (weight_elems * dtype_size(sh.autocast) if cast else 0)
    if mode == "selective":
        return qkv + attn + swiglu + weights
    r = torch.promote_types(x_dtype, sh.linear)
    stats = 2 * sh.tn * 4 + sh.tn * sh.d * dtype_size(r)
    if sh.float8:
        return stats + qkv + attn + 2 * t * sh.d + t * sh.hq * sh.hd + t * sh.f + weights
    return stats + 2 * t * sh.d * a + qkv + attn + swiglu + t * sh.f * a + weights


def _block(sh: Shapes, mode: str, x_dtype: torch.dtype, weight_elems: int) -> int:
    """Bytes one block keeps for backward under `mode`, its input and output (the residual stream) excluded."""
    a = dtype_size(sh.linear)
    t = sh.t
    if mode == "full":
        return 0
    if sh.compiled:
        return _compiled_block(sh, mode, x_dtype, weight_elems)
    if mode == "selective":
        mm = t * (sh.hq + 2 * sh.hkv) * sh.hd * a + 2 * t * sh.d * a + 2 * t * sh.f * a
        return mm + _attention(sh, keep_inputs=False)
    r = torch.promote_types(x_dtype, sh.linear)
    n = wide_dtype(r)
    out = _norm(sh, x_dtype) + _linear_inputs(sh, x_dtype, 3)
    if sh.linear != sh.master:
        out += 4 * sh.s * sh.hd * a  # cos and sin cast to the linear dtype, for q and for k
    out += _attention(sh, keep_inputs=True)
    if r == n:
        out += sh.tn * sh.d * dtype_size(r)  # the residual after attention, which ffn_norm keeps
    out += _norm(sh, r) + _linear_inputs(sh, r, 2)
    out += 4 * t * sh.f * a  # w1 x, silu(w1 x), w3 x, their product
    if sh.autocast is not None and sh.compute != sh.autocast:
        out += weight_elems * dtype_size(sh.autocast)  # the autocast weight copies the matmuls keep
    return out


def loss_bytes(sh: Shapes, chunk: int, tp: int, compiled: bool = False) -> tuple[int, int, int]:
    """(saved for backward, peak at backward start, forward peak) of the loss region, in bytes.

    `compiled`: the cross-entropy runs through torch.compile (compute.compile without loss_chunk or tp).
    """
    a, w = dtype_size(sh.linear), dtype_size(wide_dtype(sh.linear))
    t, v = sh.t, sh.v
    if compiled and chunk == 0 and tp == 1:
        # Fused: keeps the logits and one log-sum-exp per token; backward writes the logits' gradient directly
        return t * v * a + t * w + t * 8, 2 * t * v * a, t * v * a + t * w
    if chunk > 0 and tp == 1:
        # _ChunkedCrossEntropy: keeps d(loss)/d(logits) in the logits' dtype; backward scales it into a new tensor
        temps = min(chunk, t) * v * (3 * w + (a + w if a != w else 0))
        return t * v * a + w, 3 * t * v * a, 2 * t * v * a + temps
    # log-softmax output (kept), the targets view and two scalars; backward adds two log-prob-sized gradients
    saved = t * v * w + t * 8 + 2 * w
    forward = t * v * a + (t * v * w if a != w else 0) + t * v * w
    return saved, t * v * a + 3 * t * v * w, forward


def tensor_shapes(cfg: Config, strategy: str) -> Shapes:
    """Per-rank tensor sizes, dtypes and the attention kernel for `cfg` under data-parallel `strategy`."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    master = master_dtype(cfg.compute.precision)
    compute = fsdp_dtypes(p, master)[0] if strategy == "fsdp" else master
    autocast = autocast_dtype(cfg)
    linear = autocast or compute
    s = t.seq_len // p.cp
    sp = p.tp > 1 and p.sequence_parallel
    if p.cp > 1:
        kernel = "ring" if p.cp_method == "ring" else "allgather"
    elif device_type(cfg) == "cpu":
        kernel = "cpu"
    elif linear in (torch.bfloat16, torch.float16):
        kernel = "flash"
    else:
        kernel = "efficient" if linear == torch.float32 else "math"
    return Shapes(b=t.micro_batch, s=s, s_full=t.seq_len, tn=t.micro_batch * s // (p.tp if sp else 1),
                   d=m.dim, hd=m.head_dim, hq=m.n_heads // p.tp, hkv=m.n_kv_heads // p.tp,
                   f=m.ffn_dim // p.tp, v=m.vocab_size // p.tp, master=master, compute=compute, linear=linear,
                   autocast=autocast, kernel=kernel, gathered=sp, compiled=cfg.compute.compile,
                   float8=cfg.quant.float8)


def chunk_activations(cfg: Config, sh: Shapes, layers: range, first: bool, last: bool,
                       params: list[ParamShape]) -> dict[str, int]:
    """Saved bytes of one micro-batch through one chunk, split into streams, blocks, head, and workspace terms."""
    modes = ["none"] * len(layers)
    rc = cfg.compute.recompute
    for i in recomputed_blocks(rc, len(layers)):
        modes[i] = "selective" if rc == "selective" else "full"
    cast = sh.autocast is not None and sh.compute != sh.autocast
    a = dtype_size(sh.linear)
    weights = {i: sum(prm.numel for prm in params if prm.unit == i and prm.is_linear) for i in layers}

    s0 = sh.compute if first else sh.master  # the embedding output, or the received activation (fp32/fp64)
    r = torch.promote_types(s0, sh.linear)
    streams = 0
    for i in range(len(layers) + 1):
        dtype = s0 if i == 0 else r
        if i < len(layers):
            alive = modes[i] != "none" or dtype == wide_dtype(dtype) or (i == 0 and not first)
        else:
            alive = not last or dtype == wide_dtype(dtype)
        streams += sh.tn * sh.d * dtype_size(dtype) if alive else 0

    blocks = sum(_block(sh, mode, s0 if i == 0 else r, weights[layer])
                 for i, (mode, layer) in enumerate(zip(modes, layers)))
    extra = 0
    if cfg.parallel.cp > 1 and (sh.linear == sh.master or any(mo != "none" for mo in modes)):
        extra += 2 * sh.s * sh.hd * dtype_size(sh.master)  # rope_cos / rope_sin gathered at this rank's positions
    if first and cfg.parallel.tp > 1:
        extra += sh.t * 8  # vocab-parallel embedding: the masked token ids
    head = 0
    if last:
        head = _norm(sh, r) + _linear_inputs(sh, r, 1)
        if cast:
            head += sh.v * sh.d * dtype_size(sh.autocast)

    # Workspace: fourfold's autocast runs without its weight cache, so a checkpointed block's weight copies
    # live only while that block runs (one block's worth); in backward a checkpointed block is
    # rematerialised (plus its weight copies), next to gradient buffers.
    ckpt = [(mo, layer) for mo, layer in zip(modes, layers) if mo != "none"]
    cache = max((weights[layer] for _, layer in ckpt), default=0) * dtype_size(sh.autocast) if cast else 0
    remat = max((_block(sh, "none", r, weights[layer]) - _block(sh, mo, r, weights[layer]) for mo, layer in ckpt),
                default=0)
    grad_buffers = 2 * sh.tn * sh.d * dtype_size(r) + 2 * sh.t * sh.f * a
    return {"streams": streams, "blocks": blocks, "extra": extra, "head": head,
            "forward_cache": cache, "backward_transient": remat + grad_buffers,
            "block_none": _block(sh, "none", r, weights[layers[0]]) if len(layers) else 0}


def pipeline_peak(cfg: Config, pp_rank: int, per_chunk: list[int]) -> tuple[int, int]:
    """(peak bytes, peak micro-batch units) this pp rank holds, replaying its schedule's F/B order."""
    p = cfg.parallel
    if p.pp == 1:
        return sum(per_chunk), 1

    n_micro = p.pp_microbatches or grad_accumulation_steps(cfg)
    held = peak = units = peak_units = 0
    for action in SCHEDULES[p.pp_schedule](p.pp, p.vpp, n_micro, pp_rank):
        step = {"F": 1, "B": -1, "BW": -1}.get(action.kind, 0)
        held += step * per_chunk[action.chunk]
        units += step
        peak, peak_units = max(peak, held), max(peak_units, units)
    return peak, peak_units
