"""Memory prediction: the bytes one rank holds for a config and layout, component by component, before any run.

    est = estimate_memory(cfg, world_size=8)          # the rank that holds the most
    est = estimate_memory(cfg, world_size=8, rank=3)  # one rank
    console.print(est.table())
    console.print(est.compare(dp.memory_report(model, optimizer)).table())   # predicted next to measured

Components (bytes on one rank's accelerator):

| component | what | exact? |
|---|---|---|
| parameters | master weights this rank stores (fp32, or fp64 for precision fp64) | yes |
| gradients | one gradient per stored parameter element, same dtype and sharding | yes |
| optimizer | AdamW exp_avg + exp_avg_sq in the master dtype (0-d step counters left out, as `memory_report` does) | yes |
| activations | tensors autograd keeps for backward, for the micro-batches a pipeline schedule holds at once | CPU: yes; CUDA: modelled |
| logits | the loss region at the start of backward: logits, log-probabilities and their gradients | modelled |
| workspace | transient buffers: FSDP all-gathers, the block recomputed in backward, gradient buffers, autocast weight copies | modelled |

The layout is mirrored from the code that builds it: the data-parallel strategy as
`fourfold.parallel.data.build_data_parallel` picks it (ddp / zero1 / FSDP2 for zero 2 and 3 / HSDP), the
tensor-parallel plan of `fourfold.parallel.tensor_plan` (q/k/v/w1/w3 and the head split by output rows,
wo/w2 by input columns, the embedding by vocabulary rows, norms replicated), the pipeline split of
`fourfold.parallel.pipeline_split.stage_layer_counts` (embedding on the first stage, final norm and head on
the last), context parallel (seq / cp tokens per rank) and sequence parallel (norm and residual tensors
hold seq / tp positions).

Sharding, exactly as torch does it:
- FSDP2 shards dim 0 of each parameter (of its tensor-parallel shard) over the shard group and stores every
  rank's shard padded to ceil(dim0 / N) rows; gradients use the same padded storage. The padding is real
  memory, and `param_padding` reports it: `DataParallel.memory_report` counts the unpadded local shard
  (`to_local()`), so on ranks whose shard is short it is `params - param_padding`. AdamW's state is
  created with `zeros_like` of the local shard and is *not* padded.
- ZeRO-1 (`torch.distributed.optim.ZeroRedundancyOptimizer`) gives whole parameters to ranks greedily,
  largest first, per parameter group (the decayed matrices, then the norms); `zero1_partition` replays it, so
  the per-rank optimizer bytes are exact rather than 1/N.

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
| autocast copies of the block's weights (a bytes per weight element) | yes | recomputed (alive in the autocast cache until forward ends: workspace) | same |
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

Not modelled: torch.compile (inductor chooses what to save), float8 and fused kernels, the CUDA caching
allocator's fragmentation and the CUDA/NCCL context itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from fourfold.config import Config
from fourfold.errors import ConfigError
from fourfold.mesh import DIM_ORDER, grad_accumulation_steps, layout_sizes, validate_layout
from fourfold.parallel.pipeline_split import stage_layer_counts
from fourfold.recompute import recomputed_blocks
from fourfold.train.metrics import format_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}

COMPONENTS = ("params", "grads", "optimizer", "activations", "logits", "workspace")
"""Field names of the components that add up to the total, in table order."""

LABELS = {
    "params": "parameters", "grads": "gradients", "optimizer": "optimizer state", "activations": "activations",
    "logits": "logits and loss", "workspace": "workspace", "step_workspace": "optimizer step temporaries",
    "total": "total (peak)",
}

MEASURED_KEYS = {"param_bytes": "params", "grad_bytes": "grads", "optim_bytes": "optimizer",
                 "activation_bytes": "activations", "peak_bytes": "total"}
"""Keys of `DataParallel.memory_report` (and a few more) -> the component they measure."""


def _size(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype`."""
    return torch.empty((), dtype=dtype).element_size()


def _wide(dtype: torch.dtype) -> torch.dtype:
    """RMSNorm's and the loss's compute dtype: float32 for half types, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


# ----- layout ------------------------------------------------------------------------------------

def data_parallel_strategy(cfg: Config) -> str:
    """'none', 'ddp', 'zero1' or 'fsdp': the strategy `fourfold.parallel.data.build_data_parallel` builds."""
    p = cfg.parallel
    if p.dp * p.fsdp * p.cp == 1:
        return "none"
    if p.fsdp > 1 and p.zero == 1 and p.dp == 1 and p.tp == 1 and p.cp == 1:
        return "zero1"
    if p.tp > 1 or p.cp > 1 or p.fsdp > 1:
        return "fsdp"
    return "ddp"


def rank_coordinates(cfg: Config, rank: int) -> dict[str, int]:
    """Coordinates of global `rank` in the (pp, dp, fsdp, cp, tp) grid, tp fastest (as fourfold.mesh)."""
    sizes = layout_sizes(cfg)
    coords = {}
    for name in reversed(DIM_ORDER):
        coords[name] = rank % sizes[name]
        rank //= sizes[name]
    return coords


def rank_of(cfg: Config, coords: dict[str, int]) -> int:
    """The global rank at `coords` (missing dimensions are 0)."""
    sizes = layout_sizes(cfg)
    rank = 0
    for name in DIM_ORDER:
        rank = rank * sizes[name] + coords.get(name, 0)
    return rank


def fsdp_shard_group(cfg: Config, coords: dict[str, int]) -> tuple[int, int]:
    """(shard count, this rank's shard index) of FSDP2's shard dimension (`ParallelMesh.hsdp_mesh`).

    fsdp and cp form one flattened shard dimension (fsdp outer); with neither, FSDP (used because of tp)
    shards over dp. Under HSDP (dp and a shard dimension) dp only replicates.
    """
    sizes = layout_sizes(cfg)
    dims = [d for d in ("fsdp", "cp") if sizes[d] > 1]
    if not dims:
        return sizes["dp"], coords["dp"]
    size, index = 1, 0
    for d in dims:
        size *= sizes[d]
        index = index * sizes[d] + coords[d]
    return size, index


@dataclass(frozen=True)
class ParamShape:
    """One parameter as a rank holds it after tensor parallel and before data-parallel sharding."""

    name: str
    shape: tuple[int, ...]
    unit: int | None
    """The FSDP unit: the block index, or None for the chunk's root (embedding, final norm, head)."""

    @property
    def numel(self) -> int:
        """Elements of this (tensor-parallel local) parameter."""
        return math.prod(self.shape)

    @property
    def decays(self) -> bool:
        """In AdamW's decayed group (matrices and embeddings), as `fourfold.train.optim.decay_groups`."""
        return len(self.shape) >= 2

    @property
    def is_linear(self) -> bool:
        """A matmul weight that autocast casts (the embedding lookup is not autocast)."""
        return len(self.shape) == 2 and not self.name.endswith("tok_embeddings.weight")


def chunk_parameters(cfg: Config, layers: range, first: bool, last: bool) -> list[ParamShape]:
    """A model chunk's parameters in `named_parameters()` order, with tensor-parallel local shapes."""
    m, tp = cfg.model, cfg.parallel.tp
    d, hd = m.dim, m.head_dim
    q, kv, f, v = m.n_heads * hd // tp, m.n_kv_heads * hd // tp, m.ffn_dim // tp, m.vocab_size // tp
    out = []
    if first:
        out.append(ParamShape("tok_embeddings.weight", (v, d), None))
    for i in layers:
        for name, shape in (("attention_norm.weight", (d,)), ("attention.wq.weight", (q, d)),
                            ("attention.wk.weight", (kv, d)), ("attention.wv.weight", (kv, d)),
                            ("attention.wo.weight", (d, q)), ("ffn_norm.weight", (d,)),
                            ("feed_forward.w1.weight", (f, d)), ("feed_forward.w3.weight", (f, d)),
                            ("feed_forward.w2.weight", (d, f))):
            out.append(ParamShape(f"layers.{i}.{name}", shape, i))
    if last:
        out.append(ParamShape("norm.weight", (d,), None))
        if not (m.tie_embeddings and first):  # tied: the head is the embedding, counted once
            out.append(ParamShape("output.weight", (v, d), None))
    return out


def rank_chunks(cfg: Config, pp_rank: int) -> list[tuple[range, bool, bool]]:
    """(layers, has embedding, has head) for each pipeline chunk of `pp_rank` (chunk c is stage c * pp + r)."""
    p = cfg.parallel
    counts = stage_layer_counts(cfg.model.n_layers, p.pp, p.vpp, p.pp_layers)
    chunks = []
    for c in range(p.vpp):
        stage = c * p.pp + pp_rank
        start = sum(counts[:stage])
        chunks.append((range(start, start + counts[stage]), stage == 0, stage == len(counts) - 1))
    return chunks


def fsdp_rows(dim0: int, shards: int, index: int) -> tuple[int, int]:
    """(stored rows, local rows) of shard `index` of a dim-0 size `dim0` split `shards` ways by FSDP2.

    Every shard is stored padded to ceil(dim0 / shards) rows; the local (unpadded) shard is what is left
    of dim0 after the earlier shards, torch.chunk-style (possibly empty).
    """
    rows = -(-dim0 // shards)
    return rows, max(0, min(rows, dim0 - index * rows))


def zero1_partition(params: list[ParamShape], world: int) -> list[int]:
    """The rank ZeroRedundancyOptimizer assigns each parameter to (its greedy, largest-first partition).

    Parameter groups in order (decayed, then not decayed); within a group, parameters sorted by size,
    largest first (stable); each goes to the rank with the fewest elements so far (lowest index on ties).
    """
    sizes = [0] * world
    owner = [0] * len(params)
    for decays in (True, False):
        group = [i for i, prm in enumerate(params) if prm.decays == decays]
        for i in sorted(group, key=lambda j: params[j].numel, reverse=True):
            rank = sizes.index(min(sizes))
            owner[i] = rank
            sizes[rank] += params[i].numel
    return owner


# ----- the estimate ------------------------------------------------------------------------------

@dataclass
class MemoryEstimate:
    """Predicted bytes one rank holds, by component (see the module docstring for what each one is)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    workspace: int
    step_workspace: int = 0
    """Temporaries of the optimizer step (foreach AdamW's sqrt of exp_avg_sq); activations are freed by then."""
    logits_saved: int = 0
    """The part of `logits` autograd keeps from forward to backward (log-probabilities, or the chunked loss's
    stored gradient), which `saved_activation_bytes` counts."""
    saved_for_backward: int = 0
    """Bytes one micro-batch's forward and loss leave for backward on this rank: what
    `fourfold.recompute.saved_activation_bytes` measures (parameters and buffers excluded)."""
    param_padding: int = 0
    """FSDP2 padding included in `params` (gradients carry the same padding)."""
    host: int = 0
    """Bytes kept in CPU memory by parallel.cpu_offload instead (not in the total)."""
    microbatches_in_flight: int = 1
    rank: int = 0
    world_size: int = 1
    notes: list[str] = field(default_factory=list)
    breakdown: dict[str, int] = field(default_factory=dict)
    """Finer terms, for reading the estimate: per-block bytes, FSDP gathers, ..."""
    measured: dict[str, int] = field(default_factory=dict)
    """Measured bytes by component name (set by `compare`)."""

    @property
    def total(self) -> int:
        """Peak estimate: every component at its largest at once (backward start), or the optimizer step."""
        steady = self.params + self.grads + self.optimizer
        return steady + max(self.activations + self.logits + self.workspace, self.step_workspace)

    def compare(self, measured: dict[str, int]) -> "MemoryEstimate":
        """A copy with measured bytes attached, for `table()`'s measured column.

        Accepts `DataParallel.memory_report` keys (param_bytes, grad_bytes, optim_bytes), activation_bytes,
        peak_bytes (compared with the total), or component names (params, grads, ...).
        """
        named = {}
        for key, value in measured.items():
            name = MEASURED_KEYS.get(key, key)
            if name not in COMPONENTS + ("total", "step_workspace"):
                raise KeyError(f"unknown measured component '{key}'; use one of "
                               f"{', '.join(list(MEASURED_KEYS) + list(COMPONENTS))}")
            if value is not None:
                named[name] = int(value)
        return replace(self, measured={**self.measured, **named})

    def table(self):
        """A rich Table: one row per component (predicted, measured when known) and the notes as caption."""
        from rich.table import Table

        with_measured = bool(self.measured)
        who = f"rank {self.rank} of {self.world_size}"
        table = Table(title=f"Predicted memory per rank ({who})", title_justify="left",
                      caption="\n".join(self.notes), caption_justify="left")
        table.add_column("component")
        table.add_column("predicted", justify="right")
        if with_measured:
            table.add_column("measured", justify="right")
            table.add_column("error", justify="right")
        table.add_column("what")
        what = {
            "params": "master weights this rank stores" + (" (FSDP2 padding included)" if self.param_padding else ""),
            "grads": "one per stored parameter element",
            "optimizer": "AdamW exp_avg + exp_avg_sq",
            "activations": f"saved for backward, {self.microbatches_in_flight} micro-batch(es) in flight",
            "logits": "logits, log-probs and grads at backward start",
            "workspace": "all-gathers, recomputed block, grad buffers",
            "step_workspace": "AdamW temporaries (activations are freed by then)",
            "total": "params + grads + optimizer + max(act. + logits + workspace, step)",
        }
        for name in COMPONENTS + ("step_workspace", "total"):
            if name == "step_workspace" and not self.step_workspace:
                continue
            value = self.total if name == "total" else getattr(self, name)
            row = [LABELS[name], format_bytes(value)]
            if with_measured:
                got = self.measured.get(name)
                row += [format_bytes(got), "-" if got is None or not got else f"{(value - got) / got:+.1%}"]
            table.add_row(*row, what[name], style="bold" if name == "total" else None)
        return table


def _autocast_dtype(cfg: Config) -> torch.dtype | None:
    """The autocast dtype of train.precision (as fourfold.precision.PrecisionPolicy), or None."""
    return DTYPES[cfg.train.precision] if cfg.train.precision in ("bf16", "fp16") else None


def _device_type(cfg: Config) -> str:
    """'cpu' or 'cuda', resolving train.device = auto the way fourfold.distributed.pick_device does."""
    if cfg.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.train.device


@dataclass(frozen=True)
class _Shapes:
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

    @property
    def t(self) -> int:
        return self.b * self.s


def _norm(sh: _Shapes, x_dtype: torch.dtype) -> int:
    """RMSNorm's saved tensors besides its input: rsqrt, the normalised x, and the fp32 copies it makes."""
    n = _wide(x_dtype)
    out = sh.tn * _size(n) + sh.tn * sh.d * _size(n)
    if x_dtype != n:
        out += sh.tn * sh.d * _size(n)  # x.to(fp32) is what pow and the multiply keep
    if sh.compute != n:
        out += sh.d * _size(n)  # weight.to(fp32)
    return out


def _linear_inputs(sh: _Shapes, x_dtype: torch.dtype, n_linears: int) -> int:
    """What the linears reading one norm output keep of it: the tensor once, or one autocast copy each."""
    if sh.autocast is not None and x_dtype != sh.autocast:
        return n_linears * sh.t * sh.d * _size(sh.autocast)
    return sh.t * sh.d * _size(x_dtype)


def _attention(sh: _Shapes, keep_inputs: bool) -> int:
    """Bytes the attention kernel keeps: q, k, v (when `keep_inputs`), the output and its statistics."""
    a, t = _size(sh.linear), sh.t
    wide = _size(_wide(sh.linear))
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


def _block(sh: _Shapes, mode: str, x_dtype: torch.dtype, weight_elems: int) -> int:
    """Bytes one block keeps for backward under `mode`, its input and output (the residual stream) excluded."""
    a = _size(sh.linear)
    t = sh.t
    if mode == "full":
        return 0
    if mode == "selective":
        mm = t * (sh.hq + 2 * sh.hkv) * sh.hd * a + 2 * t * sh.d * a + 2 * t * sh.f * a
        return mm + _attention(sh, keep_inputs=False)
    r = torch.promote_types(x_dtype, sh.linear)
    n = _wide(r)
    out = _norm(sh, x_dtype) + _linear_inputs(sh, x_dtype, 3)
    if sh.linear != sh.master:
        out += 4 * sh.s * sh.hd * a  # cos and sin cast to the linear dtype, for q and for k
    out += _attention(sh, keep_inputs=True)
    if r == n:
        out += sh.tn * sh.d * _size(r)  # the residual after attention, which ffn_norm keeps
    out += _norm(sh, r) + _linear_inputs(sh, r, 2)
    out += 4 * t * sh.f * a  # w1 x, silu(w1 x), w3 x, their product
    if sh.autocast is not None and sh.compute != sh.autocast:
        out += weight_elems * _size(sh.autocast)  # the autocast weight copies the matmuls keep
    return out


def _loss(sh: _Shapes, chunk: int, tp: int) -> tuple[int, int, int]:
    """(saved for backward, peak at backward start, forward peak) of the loss region, in bytes."""
    a, w = _size(sh.linear), _size(_wide(sh.linear))
    t, v = sh.t, sh.v
    if chunk > 0 and tp == 1:
        # _ChunkedCrossEntropy: keeps d(loss)/d(logits) in the logits' dtype; backward scales it into a new tensor
        temps = min(chunk, t) * v * (3 * w + (a + w if a != w else 0))
        return t * v * a + w, 3 * t * v * a, 2 * t * v * a + temps
    # log-softmax output (kept), the targets view and two scalars; backward adds two log-prob-sized gradients
    saved = t * v * w + t * 8 + 2 * w
    forward = t * v * a + (t * v * w if a != w else 0) + t * v * w
    return saved, t * v * a + 3 * t * v * w, forward


def _shapes(cfg: Config, strategy: str) -> _Shapes:
    """Per-rank tensor sizes, dtypes and the attention kernel for `cfg` under data-parallel `strategy`."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    master = torch.float64 if t.precision == "fp64" else torch.float32
    compute = DTYPES[p.param_dtype] if strategy == "fsdp" and p.param_dtype != "fp32" else master
    autocast = _autocast_dtype(cfg)
    linear = autocast or compute
    s = t.seq_len // p.cp
    sp = p.tp > 1 and p.sequence_parallel
    if p.cp > 1:
        kernel = "ring" if p.cp_method == "ring" else "allgather"
    elif _device_type(cfg) == "cpu":
        kernel = "cpu"
    elif linear in (torch.bfloat16, torch.float16):
        kernel = "flash"
    else:
        kernel = "efficient" if linear == torch.float32 else "math"
    return _Shapes(b=t.micro_batch, s=s, s_full=t.seq_len, tn=t.micro_batch * s // (p.tp if sp else 1),
                   d=m.dim, hd=m.head_dim, hq=m.n_heads // p.tp, hkv=m.n_kv_heads // p.tp,
                   f=m.ffn_dim // p.tp, v=m.vocab_size // p.tp, master=master, compute=compute, linear=linear,
                   autocast=autocast, kernel=kernel, gathered=sp)


def _chunk_activations(cfg: Config, sh: _Shapes, layers: range, first: bool, last: bool,
                       params: list[ParamShape]) -> dict[str, int]:
    """Saved bytes of one micro-batch through one chunk, split into streams, blocks, head, and workspace terms."""
    modes = ["none"] * len(layers)
    rc = cfg.train.recompute
    for i in recomputed_blocks(rc, len(layers)):
        modes[i] = "selective" if rc == "selective" else "full"
    cast = sh.autocast is not None and sh.compute != sh.autocast
    a = _size(sh.linear)
    weights = {i: sum(prm.numel for prm in params if prm.unit == i and prm.is_linear) for i in layers}

    s0 = sh.compute if first else sh.master  # the embedding output, or the received activation (fp32/fp64)
    r = torch.promote_types(s0, sh.linear)
    streams = 0
    for i in range(len(layers) + 1):
        dtype = s0 if i == 0 else r
        if i < len(layers):
            alive = modes[i] != "none" or dtype == _wide(dtype) or (i == 0 and not first)
        else:
            alive = not last or dtype == _wide(dtype)
        streams += sh.tn * sh.d * _size(dtype) if alive else 0

    blocks = sum(_block(sh, mode, s0 if i == 0 else r, weights[layer])
                 for i, (mode, layer) in enumerate(zip(modes, layers)))
    extra = 0
    if cfg.parallel.cp > 1 and (sh.linear == sh.master or any(mo != "none" for mo in modes)):
        extra += 2 * sh.s * sh.hd * _size(sh.master)  # rope_cos / rope_sin gathered at this rank's positions
    if first and cfg.parallel.tp > 1:
        extra += sh.t * 8  # vocab-parallel embedding: the masked token ids
    head = 0
    if last:
        head = _norm(sh, r) + _linear_inputs(sh, r, 1)
        if cast:
            head += sh.v * sh.d * _size(sh.autocast)

    # Workspace: the autocast cache holds checkpointed blocks' weight copies until forward ends; in backward
    # a checkpointed block is rematerialised (plus its weight copies), next to gradient buffers.
    ckpt = [(mo, layer) for mo, layer in zip(modes, layers) if mo != "none"]
    cache = sum(weights[layer] for _, layer in ckpt) * _size(sh.autocast) if cast else 0
    remat = max((_block(sh, "none", r, weights[layer]) - _block(sh, mo, r, weights[layer]) for mo, layer in ckpt),
                default=0)
    grad_buffers = 2 * sh.tn * sh.d * _size(r) + 2 * sh.t * sh.f * a
    return {"streams": streams, "blocks": blocks, "extra": extra, "head": head,
            "forward_cache": cache, "backward_transient": remat + grad_buffers,
            "block_none": _block(sh, "none", r, weights[layers[0]]) if len(layers) else 0}


def _pipeline_peak(cfg: Config, pp_rank: int, per_chunk: list[int]) -> tuple[int, int]:
    """(peak bytes, peak micro-batch units) this pp rank holds, replaying its schedule's F/B order."""
    p = cfg.parallel
    if p.pp == 1:
        return sum(per_chunk), 1
    from fourfold.parallel.schedules import SCHEDULES

    n_micro = p.pp_microbatches or grad_accumulation_steps(cfg)
    held = peak = units = peak_units = 0
    for action in SCHEDULES[p.pp_schedule](p.pp, p.vpp, n_micro, pp_rank):
        step = {"F": 1, "B": -1, "BW": -1}.get(action.kind, 0)
        held += step * per_chunk[action.chunk]
        units += step
        peak, peak_units = max(peak, held), max(peak_units, units)
    return peak, peak_units


def _estimate_rank(cfg: Config, world_size: int, rank: int) -> MemoryEstimate:
    """The estimate for one global rank (the layout already validated)."""
    p, t = cfg.parallel, cfg.train
    coords = rank_coordinates(cfg, rank)
    strategy = data_parallel_strategy(cfg)
    sh = _shapes(cfg, strategy)
    master = _size(sh.master)
    chunks = rank_chunks(cfg, coords["pp"])
    params_by_chunk = [chunk_parameters(cfg, *c) for c in chunks]
    flat = [prm for ps in params_by_chunk for prm in ps]
    notes: list[str] = []
    breakdown: dict[str, int] = {}

    # Parameters, gradients, optimizer state.
    padding = 0
    if strategy == "fsdp":
        shards, index = fsdp_shard_group(cfg, coords)
        stored = local = 0
        for prm in flat:
            rows, mine = fsdp_rows(prm.shape[0], shards, index)
            rest = prm.numel // prm.shape[0]
            stored += rows * rest
            local += mine * rest
        params_b, padding, optim_b = stored * master, (stored - local) * master, 2 * local * master
        how = "HSDP" if p.dp > 1 and (p.fsdp * p.cp) > 1 else "FSDP2"
        zero = 2 if p.fsdp > 1 and p.zero == 2 else 3
        notes.append(f"{how} (ZeRO-{zero}) shards parameters, gradients and optimizer state {shards} ways; "
                     f"this rank is shard {index}.")
        if padding:
            notes.append(f"FSDP2 pads this rank's shards by {format_bytes(padding)} (in parameters and again in "
                         "gradients); memory_report counts the unpadded local shards.")
        if p.zero == 1 and p.fsdp > 1:
            notes.append("parallel.zero=1 runs as FSDP (ZeRO-3) here: ZeRO-1 needs dp = tp = cp = 1.")
    elif strategy == "zero1":
        owner = zero1_partition(flat, p.fsdp)
        mine = sum(prm.numel for prm, o in zip(flat, owner) if o == coords["fsdp"])
        params_b = sum(prm.numel for prm in flat) * master
        optim_b = 2 * mine * master
        notes.append(f"ZeRO-1 over {p.fsdp} ranks: whole parameters assigned greedily; this rank holds "
                     f"{mine / max(1, sum(prm.numel for prm in flat)):.1%} of the optimizer state.")
    else:
        params_b = sum(prm.numel for prm in flat) * master
        optim_b = 2 * params_b
    grads_b = params_b

    # Activations and the loss.
    per_chunk, saved_one = [], 0
    parts_sum: dict[str, int] = {}
    loss_saved = loss_peak = 0
    for (layers, first, last), ps in zip(chunks, params_by_chunk):
        parts = _chunk_activations(cfg, sh, layers, first, last, ps)
        for k, v in parts.items():
            parts_sum[k] = parts_sum.get(k, 0) + v
        chunk_bytes = parts["streams"] + parts["blocks"] + parts["extra"] + parts["head"]
        if last:
            loss_saved, loss_peak, loss_forward = _loss(sh, t.loss_chunk, p.tp)
            loss_peak = max(loss_peak, loss_forward)
            chunk_bytes += loss_saved
        per_chunk.append(chunk_bytes)
        saved_one += chunk_bytes
    held, in_flight = _pipeline_peak(cfg, coords["pp"], per_chunk)
    has_head = any(last for _, _, last in chunks)
    activations = held - (loss_saved if has_head else 0)  # one micro-batch's log-probs are in `logits`
    if p.pp > 1:
        notes.append(f"pipeline stage {coords['pp']} of {p.pp} ({p.pp_schedule}): activations of up to "
                     f"{in_flight} micro-batch units in flight.")
    n_layers = sum(len(c[0]) for c in chunks)
    breakdown.update(block_without_recompute=parts_sum["block_none"] // len(chunks), streams=parts_sum["streams"],
                     blocks=parts_sum["blocks"], head=parts_sum["head"], loss_saved=loss_saved, layers=n_layers)

    # Workspace.
    act_ws = max(parts_sum["forward_cache"], parts_sum["backward_transient"])
    fsdp_ws = 0
    if strategy == "fsdp":
        unit_bytes: dict = {}
        for ci, ps in enumerate(params_by_chunk):
            for prm in ps:
                key = (ci, prm.unit)
                unit_bytes[key] = unit_bytes.get(key, 0) + prm.numel
        root = sum(v for (ci, u), v in unit_bytes.items() if u is None)
        blocks = [v for (ci, u), v in unit_bytes.items() if u is not None]
        big = max(blocks, default=0)
        reshard = p.reshard_after_forward and not (p.fsdp > 1 and p.zero == 2)
        depth = max(0, min(p.prefetch, p.max_inflight_allgathers))
        gathered = (root + (1 + depth) * big) if reshard else (root + sum(blocks))
        grad_unsharded = big * max(_size(sh.compute), _size(DTYPES[p.reduce_dtype]))
        fsdp_ws = gathered * _size(sh.compute) + big * _size(sh.compute) + grad_unsharded
        breakdown["fsdp_gathered"] = gathered * _size(sh.compute)
    workspace = act_ws + fsdp_ws  # DDP and ZeRO-1 keep gradients as views into their buckets: no copy
    breakdown.update(activation_workspace=act_ws, fsdp_workspace=fsdp_ws)

    # Optimizer step temporaries: fused AdamW on CUDA has none; foreach makes one moment-sized list; the
    # for-loop (ZeRO-1 on CPU) one parameter at a time.
    cuda = _device_type(cfg) == "cuda"
    if cuda:
        step_ws = 0
    elif strategy == "zero1":
        step_ws = max((prm.numel for prm in flat), default=0) * master
    else:
        step_ws = optim_b // 2

    host = 0
    if p.cpu_offload and strategy == "fsdp":
        host = params_b + grads_b + optim_b
        params_b = grads_b = optim_b = 0
        notes.append(f"cpu_offload: {format_bytes(host)} of sharded parameters, gradients and optimizer state "
                     "live in host memory (not in the total).")
    kernel_note = {"cpu": "CPU SDPA (same saved tensors as CUDA flash attention)",
                   "flash": "CUDA flash attention", "efficient": "CUDA memory-efficient attention (fp32)",
                   "math": "CUDA math attention (approximate)", "ring": "ring attention (modelled)",
                   "allgather": "all-gather attention (modelled)"}[sh.kernel]
    notes.append(f"activations: recompute {t.recompute}, micro-batch {t.micro_batch} x {sh.s} tokens, "
                 f"{kernel_note}; workspace is a model, not a measurement.")
    if t.compile:
        notes.append("train.compile: inductor chooses what to save; activations are for eager mode.")
    return MemoryEstimate(
        params=params_b, grads=grads_b, optimizer=optim_b, activations=activations, logits=loss_peak,
        workspace=workspace, step_workspace=step_ws, logits_saved=loss_saved, saved_for_backward=saved_one,
        param_padding=padding if not host else 0, host=host, microbatches_in_flight=in_flight, rank=rank,
        world_size=world_size, notes=notes, breakdown=breakdown,
    )


def estimate_memory(cfg: Config, world_size: int, rank: int | None = None) -> MemoryEstimate:
    """Predict the bytes one rank holds when `cfg` trains on `world_size` ranks.

    `rank` picks the rank; None estimates every kind of rank (each pipeline stage; under ZeRO-1 the rank
    with the largest optimizer share; FSDP's shard 0, which has no padding to spare) and returns the one
    with the largest total, saying so in its notes. Raises LayoutError when the layout cannot run.
    """
    validate_layout(cfg, world_size)
    if rank is not None:
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside 0..{world_size - 1}.")
        return _estimate_rank(cfg, world_size, rank)
    p = cfg.parallel
    candidates = []
    for stage in range(p.pp):
        coords = {"pp": stage}
        if data_parallel_strategy(cfg) == "zero1":
            flat = [prm for c in rank_chunks(cfg, stage) for prm in chunk_parameters(cfg, *c)]
            owner = zero1_partition(flat, p.fsdp)
            share = [sum(prm.numel for prm, o in zip(flat, owner) if o == r) for r in range(p.fsdp)]
            coords["fsdp"] = share.index(max(share))
        candidates.append(_estimate_rank(cfg, world_size, rank_of(cfg, coords)))
    best = max(candidates, key=lambda e: e.total)
    if world_size > 1:
        best.notes.insert(0, f"Rank {best.rank} is the rank that holds the most; other ranks hold the same or less.")
    return best


def measure_saved_activations(cfg: Config, device: str | torch.device | None = None) -> int:
    """Bytes one micro-batch's forward and loss leave for backward in a single process (no parallel layout).

    Builds the model of `cfg` on `device` (default: cfg.train.device), applies cfg.train.recompute, runs
    forward under the precision's autocast and the loss, and measures with
    `fourfold.recompute.saved_activation_bytes` (parameters and buffers excluded). Compare with
    `estimate_memory(cfg, 1).saved_for_backward`; this is how the activation formulas are calibrated.
    """
    from fourfold.distributed import pick_device
    from fourfold.models.llama import Llama
    from fourfold.ops.cross_entropy import cross_entropy
    from fourfold.recompute import apply_recompute, saved_activation_bytes

    p = cfg.parallel
    if p.dp * p.fsdp * p.tp * p.pp * p.cp != 1:
        raise ConfigError("measure_saved_activations measures the single-process model; set every parallel "
                          "degree to 1 (sharded layouts are measured through the trainer).")
    dev = torch.device(device) if device is not None else pick_device(cfg.train.device)
    torch.manual_seed(cfg.train.seed)
    model = Llama(cfg.model).to(dev, torch.float64 if cfg.train.precision == "fp64" else torch.float32)
    apply_recompute(model, cfg.train.recompute)
    shape = (cfg.train.micro_batch, cfg.train.seq_len)
    tokens = torch.randint(0, cfg.model.vocab_size, shape, device=dev)
    targets = torch.randint(0, cfg.model.vocab_size, shape, device=dev)
    autocast = _autocast_dtype(cfg)

    def forward_and_loss():
        with torch.autocast(dev.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            logits = model(tokens)
        return cross_entropy(logits, targets, cfg.train.loss_chunk)

    state = tuple(model.parameters()) + tuple(model.buffers())
    _, saved = saved_activation_bytes(forward_and_loss, exclude=state)
    return saved
