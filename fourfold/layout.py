"""Every rule about a parallel layout, in one place, checked once before any process group exists.

    validate_layout(cfg, world_size)     # LayoutError saying what to change, or None
    layout_sizes(cfg), data_parallel_strategy(cfg.parallel), grad_accumulation_steps(cfg)

Dimension order, outermost first: pp, dp, fsdp, cp, tp. Tensor parallel is innermost so its per-layer
collectives stay between neighbouring ranks (the same node, the fastest links); pipeline is outermost
because it sends the least. A parallel file may own a rule about itself as a pure function that
raises LayoutError (context parallel's sequence split, the pipeline schedules' constraints, the
pipeline split); `validate_layout` runs them here, and lower levels assert what these rules guarantee
(or call the same function) rather than re-checking them with their own words. The command line runs
`validate_layout` against `--nproc N` before it launches torchrun, the trainer against WORLD_SIZE
before `init_distributed`, and `ParallelMesh.build` once more before it creates groups.
"""

from __future__ import annotations

from fourfold.config import Config, ModelConfig, ParallelConfig
from fourfold.errors import LayoutError
from fourfold.parallel.context import check_sequence_split
from fourfold.parallel.pipeline.schedules import check_schedule
from fourfold.parallel.pipeline.split import stage_layer_counts
from fourfold.quant.float8 import require_torchao

DIM_ORDER = ("pp", "dp", "fsdp", "cp", "tp")
STRATEGY_WORDS = {"none": "a single data rank", "ddp": "DDP", "zero1": "ZeRO-1", "fsdp": "FSDP"}


def layout_sizes(cfg: Config) -> dict[str, int]:
    """Size of each parallel dimension (pp, dp, fsdp, cp, tp) the config asks for."""
    p = cfg.parallel
    return {"pp": p.pp, "dp": p.dp, "fsdp": p.fsdp, "cp": p.cp, "tp": p.tp}


def describe_layout(sizes: dict[str, int]) -> str:
    """'pp=2 x fsdp=4', or 'a single rank'."""
    return " x ".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "a single rank"


def grad_accumulation_steps(cfg: Config) -> int:
    """Micro-steps per optimizer step: global_batch / (micro_batch * dp * fsdp)."""
    t, p = cfg.train, cfg.parallel
    return t.global_batch // (t.micro_batch * p.dp * p.fsdp)


def data_parallel_strategy(p: ParallelConfig) -> str:
    """'none', 'ddp', 'zero1' or 'fsdp': the strategy `fourfold.parallel.data_parallel.build_data_parallel` builds.

    zero=1 under dp, tp or cp would be FSDP here; `validate_layout` refuses that layout, so it never runs."""
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


def check_global_batch(global_batch: int, micro_batch: int, data_ranks: int) -> None:
    """The batch rule: global_batch splits into whole micro-batches on each of the dp * fsdp data ranks."""
    if global_batch % (micro_batch * data_ranks):
        raise LayoutError(
            f"train.global_batch ({global_batch}) must be a multiple of train.micro_batch * data-parallel ranks "
            f"(dp * fsdp) = {micro_batch} * {data_ranks} = {micro_batch * data_ranks}. Change train.micro_batch "
            "or the global batch.")


def check_ranks_per_node(dp: int, per_node: int) -> None:
    """The hierarchical all-reduce's rule: the dp ranks fill whole nodes."""
    if per_node < 1 or dp % per_node:
        raise LayoutError(f"Hierarchical all-reduce needs parallel.dp ({dp}) to be a multiple of the ranks per node "
                          f"({per_node}); set parallel.gpus_per_node, or --parallel.hierarchical_allreduce false.")


def validate_layout(cfg: Config, world_size: int) -> None:
    """Raise LayoutError, saying what to change, if the layout cannot run on `world_size` ranks."""
    _check_world(cfg, world_size)
    _check_split_dimensions(cfg)
    _check_data_parallel(cfg)
    _check_pipeline(cfg)


def _check_world(cfg: Config, world_size: int) -> None:
    sizes = layout_sizes(cfg)
    product = 1
    for v in sizes.values():
        product *= v
    if product != world_size:
        raise LayoutError(
            f"The layout {describe_layout(sizes)} uses {product} ranks but {world_size} were started. Make "
            f"parallel.pp * dp * fsdp * cp * tp equal {world_size} (for pure data parallel: --parallel.fsdp "
            f"{world_size} or --parallel.dp {world_size}), or start {product} processes "
            f"(--nproc {product}, or torchrun --nproc-per-node {product})."
        )


def _check_split_dimensions(cfg: Config) -> None:
    """Tensor, sequence and context parallel: what they cut must divide evenly."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if p.tp > 1:
        check_tensor_parallel(m, p.tp)
        if p.sequence_parallel and t.seq_len % p.tp:
            raise LayoutError(f"Sequence parallel splits train.seq_len ({t.seq_len}) across tp={p.tp} ranks; "
                              "make seq_len a multiple of tp or set --parallel.sequence_parallel false.")
    if p.cp > 1:
        check_sequence_split(t.seq_len, p.cp)
    if cfg.quant.float8:
        if p.tp > 1:
            raise LayoutError(f"quant.float8 is not supported with tensor parallel (tp={p.tp}): torchao's float8 "
                              "linears need their own tensor-parallel styles. Set --parallel.tp 1 (shard with "
                              "--parallel.fsdp instead) or --quant.float8 false.")
        require_torchao()


def _check_data_parallel(cfg: Config) -> None:
    """The batch split and what the chosen data-parallel strategy supports."""
    t, p = cfg.train, cfg.parallel
    shown = describe_layout(layout_sizes(cfg))
    strategy = data_parallel_strategy(p)
    what = STRATEGY_WORDS[strategy]
    if p.zero == 1 and strategy == "fsdp":
        raise LayoutError(f"parallel.zero = 1 (ZeRO-1: only optimizer state sharded) runs only with "
                          f"parallel.fsdp > 1 and dp = tp = cp = 1; this layout ({shown}) would shard with FSDP "
                          "(ZeRO-3) instead. Set --parallel.zero 3 (or 2) to shard with FSDP, or set parallel.dp, "
                          "parallel.tp and parallel.cp to 1 to keep ZeRO-1.")
    if p.param_dtype != "fp32" and strategy != "fsdp":
        raise LayoutError(f"parallel.param_dtype ({p.param_dtype}) is FSDP's mixed-precision setting, but this "
                          f"layout uses {what}. Shard with --parallel.fsdp N (zero 2 or 3), or keep it fp32 and "
                          "use --compute.precision bf16 (autocast).")
    if p.reduce_dtype != "fp32" and (strategy not in ("ddp", "fsdp") or p.hierarchical_allreduce):
        how = "the hierarchical all-reduce" if strategy == "ddp" else what
        raise LayoutError(f"parallel.reduce_dtype ({p.reduce_dtype}) sets the dtype gradients are reduced in, which "
                          f"FSDP and plain DDP support but not {how}. Keep --parallel.reduce_dtype fp32, or use "
                          "--parallel.dp N without the hierarchical all-reduce, or --parallel.fsdp N.")
    if p.hierarchical_allreduce and strategy != "ddp":
        raise LayoutError(f"parallel.hierarchical_allreduce is a DDP comm hook, but this layout ({shown}) uses {what}; "
                          "set --parallel.hierarchical_allreduce false, or use --parallel.dp N alone.")
    if p.hierarchical_allreduce and p.gpus_per_node:
        check_ranks_per_node(p.dp, p.gpus_per_node)  # 0: LOCAL_WORLD_SIZE, known only once launched
    if p.cpu_offload and strategy != "fsdp":
        raise LayoutError(f"parallel.cpu_offload keeps FSDP's shards in CPU memory, but this layout ({shown}) uses "
                          f"{what}; shard with --parallel.fsdp N (zero 2 or 3), or set --parallel.cpu_offload false.")
    c = cfg.compute
    if c.compile and c.compile_scope == "model" and (strategy not in ("none", "ddp") or p.pp > 1):  # tp/cp imply fsdp
        raise LayoutError(f"compute.compile_scope model compiles the whole forward, which this layout ({shown}, "
                          f"{strategy}) splits with hooks, DTensors or pipeline stages; use --compute.compile_scope "
                          "blocks (each block compiled), or run on one GPU or plain DDP.")
    check_global_batch(t.global_batch, t.micro_batch, p.dp * p.fsdp)


def _check_pipeline(cfg: Config) -> None:
    """Stages against layers, tied embeddings, micro-batches, and the schedule's own rules."""
    m, p = cfg.model, cfg.parallel
    stages = p.pp * p.vpp
    if m.n_layers < stages:
        raise LayoutError(f"model.n_layers ({m.n_layers}) is fewer than the pp*vpp={stages} pipeline stages; "
                          "lower parallel.pp or parallel.vpp.")
    if p.pp > 1 and m.tie_embeddings:
        raise LayoutError("Tied embeddings put one weight on the first and last pipeline stages; set "
                          "--model.tie_embeddings false or --parallel.pp 1.")
    if p.pp == 1 and p.vpp == 1:
        for key, value in (("pp_layers", p.pp_layers), ("pp_microbatches", p.pp_microbatches)):
            if value:
                raise LayoutError(f"parallel.{key} ({value}) shapes a pipeline, but parallel.pp is 1; set "
                                  f"--parallel.pp 2 or more, or leave parallel.{key} unset.")
        return
    accumulation = grad_accumulation_steps(cfg)
    if p.pp > 1 and p.pp_microbatches and p.pp_microbatches != accumulation:
        raise LayoutError(f"parallel.pp_microbatches ({p.pp_microbatches}) must equal global_batch / (micro_batch "
                          f"* dp * fsdp) = {accumulation}; set it to 0 to derive it.")
    check_schedule(p.pp_schedule, p.pp, p.vpp, accumulation)
    stage_layer_counts(m.n_layers, p.pp, p.vpp, p.pp_layers)


def grid_coordinates(sizes: dict[str, int], rank: int) -> dict[str, int]:
    """Row-major coordinates of `rank` in the (pp, dp, fsdp, cp, tp) grid, tp fastest."""
    coords = {}
    for name in reversed(DIM_ORDER):
        coords[name] = rank % sizes[name]
        rank //= sizes[name]
    return coords
