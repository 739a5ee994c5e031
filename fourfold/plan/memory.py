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

The layout is derived from the code that builds it: the data-parallel strategy as
`fourfold.parallel.data_parallel.build_data_parallel` picks it (ddp / zero1 / FSDP2 for zero 2 and 3 / HSDP), the
tensor-parallel plan of `fourfold.parallel.tensor_plan` (q/k/v/w1/w3 and the head split by output rows,
wo/w2 by input columns, the embedding by vocabulary rows, norms replicated), the pipeline split of
`fourfold.parallel.pipeline.split.split_pipeline` (embedding on the first stage, final norm and head on
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

The parameters each rank holds come from `fourfold.plan.layout` (the meta-device model, split and
tensor-parallel-sharded as the builder does it); FSDP's reshard, prefetch and dtype rules are the functions
`fourfold.parallel.fsdp.apply_fsdp` uses; activations are modelled by `fourfold.plan.activations`
(whose docstring lists what each block keeps under each recompute mode).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from fourfold.config import Config
from fourfold.distributed import pick_device
from fourfold.errors import ConfigError
from fourfold.layout import data_parallel_strategy, grad_accumulation_steps, validate_layout
from fourfold.models.llama import Llama
from fourfold.precision import master_dtype
from fourfold.ops.cross_entropy import cross_entropy
from fourfold.plan.activations import (autocast_dtype, chunk_activations, device_type, dtype_size,
                                       loss_bytes, pipeline_peak, tensor_shapes)
from fourfold.parallel.fsdp import block_reshards_after_forward, fsdp_dtypes, prefetch_depth, reshards_after_forward
from fourfold.plan.layout import fsdp_rows, fsdp_shard_group, rank_chunks, rank_coordinates, rank_of, zero1_partition
from fourfold.recompute import apply_recompute, saved_activation_bytes
from fourfold.units import format_bytes

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
    grads_held: bool = True
    """Gradients exist when backward starts: DDP's persistent buckets, or a step of several micro-batches. False
    when `zero_grad(set_to_none=True)` freed them and this micro-batch is the step's only one: they then grow
    as activations are freed, and the peak is the larger of backward's start and its end (every gradient)."""
    exclusive_workspace: int = 0
    """The part of `workspace` that never coexists with the loss region's peak (the block rematerialised in
    backward and its gradient buffers come after the logits' gradients are freed)."""
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
        backward = self.activations + self.logits + self.workspace - min(self.logits, self.exclusive_workspace)
        if self.grads_held:
            return self.params + self.grads + self.optimizer + max(backward, self.step_workspace)
        late = self.grads + max(self.step_workspace, self.exclusive_workspace)
        return self.params + self.optimizer + max(backward, late)

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
            "total": "params + grads + optimizer + max(act. + max(logits, recompute) + rest, step)",
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


def _estimate_rank(cfg: Config, world_size: int, rank: int) -> MemoryEstimate:
    """The estimate for one global rank (the layout already validated)."""
    p, t = cfg.parallel, cfg.train
    coords = rank_coordinates(cfg, rank)
    strategy = data_parallel_strategy(cfg.parallel)
    sh = tensor_shapes(cfg, strategy)
    master = dtype_size(sh.master)
    chunks = rank_chunks(cfg, coords["pp"])
    flat = [prm for chunk in chunks for prm in chunk.params]
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
        zero = 3 if reshards_after_forward(p) else 2  # parameters kept gathered from forward to backward
        notes.append(f"{how} (ZeRO-{zero}) shards parameters, gradients and optimizer state {shards} ways; "
                     f"this rank is shard {index}.")
        if padding:
            notes.append(f"FSDP2 pads this rank's shards by {format_bytes(padding)} (in parameters and again in "
                         "gradients); memory_report counts the unpadded local shards.")
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
    for chunk in chunks:
        parts = chunk_activations(cfg, sh, chunk.layers, chunk.first, chunk.last, chunk.params)
        for k, v in parts.items():
            parts_sum[k] = parts_sum.get(k, 0) + v
        chunk_bytes = parts["streams"] + parts["blocks"] + parts["extra"] + parts["head"]
        if chunk.last:
            loss_saved, loss_peak, loss_forward = loss_bytes(sh, cfg.compute.loss_chunk, p.tp, cfg.compute.compile)
            loss_peak = max(loss_peak, loss_forward)
            chunk_bytes += loss_saved
        per_chunk.append(chunk_bytes)
        saved_one += chunk_bytes
    held, in_flight = pipeline_peak(cfg, coords["pp"], per_chunk)
    has_head = any(chunk.last for chunk in chunks)
    activations = held - (loss_saved if has_head else 0)  # one micro-batch's log-probs are in `logits`
    if p.pp > 1:
        notes.append(f"pipeline stage {coords['pp']} of {p.pp} ({p.pp_schedule}): activations of up to "
                     f"{in_flight} micro-batch units in flight.")
    n_layers = sum(len(chunk.layers) for chunk in chunks)
    breakdown.update(block_without_recompute=parts_sum["block_none"] // len(chunks), streams=parts_sum["streams"],
                     blocks=parts_sum["blocks"], head=parts_sum["head"], loss_saved=loss_saved, layers=n_layers)

    # Workspace.
    act_ws = max(parts_sum["forward_cache"], parts_sum["backward_transient"])
    fsdp_ws = 0
    if strategy == "fsdp":
        # Gathered at the start of backward: each chunk's root and the blocks apply_fsdp keeps gathered after
        # forward (fourfold.parallel.fsdp's policy), plus the blocks prefetched while one is computed.
        root = kept = big = 0
        for chunk in chunks:
            units = [sum(prm.numel for prm in chunk.params if prm.unit == layer) for layer in chunk.layers]
            root += sum(prm.numel for prm in chunk.params if prm.unit is None)
            kept += sum(n for i, n in enumerate(units) if not block_reshards_after_forward(p, i, len(units)))
            big = max([big, *units])
        gathered = root + kept + (prefetch_depth(p) * big if reshards_after_forward(p) else 0)
        reduce = fsdp_dtypes(p, sh.master)[1]
        grad_unsharded = big * max(dtype_size(sh.compute), dtype_size(reduce))
        fsdp_ws = gathered * dtype_size(sh.compute) + big * dtype_size(sh.compute) + grad_unsharded
        breakdown["fsdp_gathered"] = gathered * dtype_size(sh.compute)
    workspace = act_ws + fsdp_ws  # DDP and ZeRO-1 keep gradients as views into their buckets: no copy
    breakdown.update(activation_workspace=act_ws, fsdp_workspace=fsdp_ws)

    # Optimizer step temporaries: fused AdamW on CUDA has none; foreach makes one moment-sized list; the
    # for-loop (ZeRO-1 on CPU) one parameter at a time.
    cuda = device_type(cfg) == "cuda"
    if cuda:
        step_ws = 0
    elif strategy == "zero1":
        step_ws = max((prm.numel for prm in flat), default=0) * master
    else:
        step_ws = optim_b // 2

    grads_held = strategy in ("ddp", "zero1") or p.pp > 1 or grad_accumulation_steps(cfg) > 1
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
    notes.append(f"activations: recompute {cfg.compute.recompute}, micro-batch {t.micro_batch} x {sh.s} tokens, "
                 f"{kernel_note}; workspace is a model, not a measurement.")
    if cfg.compute.compile:
        notes.append("compute.compile: inductor chooses what to save; activations are for eager mode.")
    if cfg.quant.float8 and not cfg.compute.compile:
        notes.append("quant.float8 in eager mode: modelled as bf16 (the float8 model is for compiled blocks).")
    return MemoryEstimate(
        params=params_b, grads=grads_b, optimizer=optim_b, activations=activations, logits=loss_peak,
        workspace=workspace, step_workspace=step_ws, grads_held=grads_held,
        exclusive_workspace=act_ws if has_head else 0, logits_saved=loss_saved, saved_for_backward=saved_one,
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
        if data_parallel_strategy(cfg.parallel) == "zero1":
            flat = [prm for chunk in rank_chunks(cfg, stage) for prm in chunk.params]
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

    Builds the model of `cfg` on `device` (default: cfg.compute.device), applies cfg.compute.recompute, runs
    forward under the precision's autocast and the loss, and measures with
    `fourfold.recompute.saved_activation_bytes` (parameters and buffers excluded). Compare with
    `estimate_memory(cfg, 1).saved_for_backward`; this is how the activation formulas are calibrated.
    """

    p = cfg.parallel
    if p.dp * p.fsdp * p.tp * p.pp * p.cp != 1:
        raise ConfigError("measure_saved_activations measures the single-process model; set every parallel "
                          "degree to 1 (sharded layouts are measured through the trainer).")
    dev = torch.device(device) if device is not None else pick_device(cfg.compute.device)
    torch.manual_seed(cfg.train.seed)
    model = Llama(cfg.model).to(dev, master_dtype(cfg.compute.precision))
    apply_recompute(model, cfg.compute.recompute)
    shape = (cfg.train.micro_batch, cfg.train.seq_len)
    tokens = torch.randint(0, cfg.model.vocab_size, shape, device=dev)
    targets = torch.randint(0, cfg.model.vocab_size, shape, device=dev)
    autocast = autocast_dtype(cfg)

    def forward_and_loss():
        with torch.autocast(dev.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            logits = model(tokens)
        return cross_entropy(logits, targets, cfg.compute.loss_chunk)

    state = tuple(model.parameters()) + tuple(model.buffers())
    _, saved = saved_activation_bytes(forward_and_loss, exclude=state)
    return saved
