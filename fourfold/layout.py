"""Every rule about a parallel layout, in one place, checked once before any process group exists.

    validate_layout(cfg, world_size)     # LayoutError saying what to change, or None
    layout_sizes(cfg), data_parallel_strategy(cfg.parallel), grad_accumulation_steps(cfg)

Dimension order, outermost first: pp, dp, fsdp, cp, tp. Tensor parallel is innermost so its per-layer
collectives stay between neighbouring ranks (the same node, the fastest links); pipeline is outermost
because it sends the least. Lower levels (the pipeline executor, context parallel, the dataset) assert
what these rules guarantee rather than re-checking them with their own words.
"""

from __future__ import annotations

from fourfold.config import Config, ModelConfig, ParallelConfig
from fourfold.errors import LayoutError
from fourfold.parallel.pipeline.schedules import build_schedule
from fourfold.quant.float8 import require_torchao

DIM_ORDER = ("pp", "dp", "fsdp", "cp", "tp")


def layout_sizes(cfg: Config) -> dict[str, int]:
    """Size of each parallel dimension (pp, dp, fsdp, cp, tp) the config asks for."""
    p = cfg.parallel
    return {"pp": p.pp, "dp": p.dp, "fsdp": p.fsdp, "cp": p.cp, "tp": p.tp}


def grad_accumulation_steps(cfg: Config) -> int:
    """Micro-steps per optimizer step: global_batch / (micro_batch * dp * fsdp)."""
    t, p = cfg.train, cfg.parallel
    return t.global_batch // (t.micro_batch * p.dp * p.fsdp)


def data_parallel_strategy(p: ParallelConfig) -> str:
    """'none', 'ddp', 'zero1' or 'fsdp': the strategy `fourfold.parallel.data_parallel.build_data_parallel` builds."""
    if p.dp * p.fsdp * p.cp == 1:
        return "none"
    if p.fsdp > 1 and p.zero == 1 and p.dp == 1 and p.tp == 1 and p.cp == 1:
        return "zero1"
    if p.tp > 1 or p.cp > 1 or p.fsdp > 1:
        return "fsdp"
    return "ddp"


def check_tensor_parallel(model: ModelConfig, tp: int) -> None:
    """Raise LayoutError unless tp divides every dimension tensor parallel splits."""
    for name, value in (("model.n_heads", model.n_heads), ("model.n_kv_heads", model.n_kv_heads),
                        ("model.ffn_dim", model.ffn_dim), ("model.vocab_size", model.vocab_size)):
        if value % tp:
            raise LayoutError(f"parallel.tp={tp} must divide {name} ({value}): tensor parallel splits it "
                              f"across ranks (kv heads are split, not replicated). Pick a tp that divides {value}.")


def validate_layout(cfg: Config, world_size: int) -> None:
    """Raise LayoutError, saying what to change, if the layout cannot run on `world_size` ranks."""
    sizes = layout_sizes(cfg)
    product = 1
    for v in sizes.values():
        product *= v
    shown = " x ".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "a single rank"
    if product != world_size:
        raise LayoutError(
            f"The layout {shown} uses {product} ranks but {world_size} were started. Make "
            f"parallel.pp * dp * fsdp * cp * tp equal {world_size} (for pure data parallel: --parallel.fsdp "
            f"{world_size} or --parallel.dp {world_size}), or start {product} processes "
            f"(torchrun --nproc-per-node {product})."
        )
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if p.tp > 1:
        check_tensor_parallel(m, p.tp)
        if p.sequence_parallel and t.seq_len % p.tp:
            raise LayoutError(f"Sequence parallel splits train.seq_len ({t.seq_len}) across tp={p.tp} ranks; "
                              "make seq_len a multiple of tp or set --parallel.sequence_parallel false.")
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        raise LayoutError(f"Context parallel splits each sequence into 2*cp={2 * p.cp} chunks (load balance); "
                          f"train.seq_len ({t.seq_len}) must be a multiple of {2 * p.cp}.")
    strategy = data_parallel_strategy(cfg.parallel)
    what = {"none": "a single data rank", "ddp": "DDP", "zero1": "ZeRO-1", "fsdp": "FSDP"}[strategy]
    if p.param_dtype != "fp32" and strategy != "fsdp":
        raise LayoutError(f"parallel.param_dtype ({p.param_dtype}) is FSDP's mixed-precision setting, but this "
                          f"layout uses {what}. Shard with --parallel.fsdp N (zero 2 or 3), or keep it fp32 and "
                          "use --compute.precision bf16 (autocast).")
    if p.reduce_dtype != "fp32" and (strategy not in ("ddp", "fsdp") or p.hierarchical_allreduce):
        how = "the hierarchical all-reduce" if strategy == "ddp" else what
        raise LayoutError(f"parallel.reduce_dtype ({p.reduce_dtype}) sets the dtype gradients are reduced in, which "
                          f"FSDP and plain DDP support but not {how}. Keep --parallel.reduce_dtype fp32, or use "
                          "--parallel.dp N without the hierarchical all-reduce, or --parallel.fsdp N.")
    if cfg.compute.compile and cfg.compute.compile_scope == "model" and (strategy not in ("none", "ddp") or p.pp > 1):  # tp/cp imply fsdp
        raise LayoutError(f"compute.compile_scope model compiles the whole forward, which this layout ({shown}, "
                          f"{strategy}) splits with hooks, DTensors or pipeline stages; use --compute.compile_scope "
                          "blocks (each block compiled), or run on one GPU or plain DDP.")
    if cfg.quant.float8:
        if p.tp > 1:
            raise LayoutError(f"quant.float8 is not supported with tensor parallel (tp={p.tp}): torchao's float8 "
                              "linears need their own tensor-parallel styles. Set --parallel.tp 1 (shard with "
                              "--parallel.fsdp instead) or --quant.float8 false.")
        require_torchao()
    stages = p.pp * p.vpp
    if p.vpp > 1 and p.pp == 1:
        raise LayoutError(f"parallel.vpp={p.vpp} splits each pipeline rank into virtual stages but parallel.pp is 1; "
                          "set --parallel.pp 2 or more, or --parallel.vpp 1.")
    if p.vpp > 1 and p.pp_schedule not in ("interleaved-1f1b", "zero-bubble"):
        raise LayoutError(f"parallel.vpp={p.vpp} needs an interleaved schedule; set "
                          "--parallel.pp_schedule interleaved-1f1b or --parallel.vpp 1.")
    if m.n_layers < stages:
        raise LayoutError(f"model.n_layers ({m.n_layers}) is fewer than the pp*vpp={stages} pipeline stages; "
                          "lower parallel.pp or parallel.vpp.")
    if p.pp > 1 and m.tie_embeddings:
        raise LayoutError("Tied embeddings put one weight on the first and last pipeline stages; set "
                          "--model.tie_embeddings false or --parallel.pp 1.")
    per_step = t.micro_batch * p.dp * p.fsdp
    if t.global_batch % per_step:
        raise LayoutError(
            f"train.global_batch ({t.global_batch}) must be a multiple of micro_batch * dp * fsdp = "
            f"{t.micro_batch} * {p.dp} * {p.fsdp} = {per_step}. Change train.micro_batch or the global batch."
        )
    if p.pp > 1:
        micro = p.pp_microbatches or grad_accumulation_steps(cfg)
        if p.pp_microbatches and p.pp_microbatches != grad_accumulation_steps(cfg):
            raise LayoutError(
                f"parallel.pp_microbatches ({p.pp_microbatches}) must equal global_batch / (micro_batch * dp "
                f"* fsdp) = {grad_accumulation_steps(cfg)}; set it to 0 to derive it."
            )
        if p.pp_schedule == "interleaved-1f1b" and micro % p.pp:
            raise LayoutError(f"Interleaved 1F1B needs the micro-batches per step ({micro}) to be a multiple of "
                              f"pp ({p.pp}); change train.global_batch or train.micro_batch.")
        build_schedule(p.pp_schedule, p.pp, p.vpp, micro, 0)  # the schedule's own rules, checked before init


def grid_coordinates(sizes: dict[str, int], rank: int) -> dict[str, int]:
    """Row-major coordinates of `rank` in the (pp, dp, fsdp, cp, tp) grid, tp fastest."""
    coords = {}
    for name in reversed(DIM_ORDER):
        coords[name] = rank % sizes[name]
        rank //= sizes[name]
    return coords
