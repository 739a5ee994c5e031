"""The layout search: every layout of a search space that `fourfold.layout.validate_layout` accepts, ranked.

    space = SearchSpace()                                    # what may vary (see its fields)
    layouts = enumerate_layouts(base_cfg, world=64, space=space, gpus_per_node=8)   # valid configs, in order
    ranked = rank_layouts(base_cfg, 64, cluster_hw, "h100", 8, "ib400", top=10)     # fastest that fit

A candidate is the base config with the parallel degrees (tp inside a node, then cp, pp with vpp and a
schedule; blocks split evenly over the pipeline stages, or as evenly as they go with the first stages
one block longer, the data-parallel rest as DDP, ZeRO-1/2/3 or HSDP), the micro-batch, the recompute mode, float8,
compile and sequence parallel set; it is kept only if `validate_layout` accepts it, so nothing proposed is
refused by the trainer. Enumeration order is fixed (loops over sorted values), so the search is
deterministic; ties in predicted time keep that order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

from fourfold.config import Config, validate
from fourfold.errors import ConfigError, LayoutError
from fourfold.layout import data_parallel_strategy, grad_accumulation_steps, validate_layout
from fourfold.plan.hardware import Hardware
from fourfold.plan.predict import Prediction, predict
from fourfold.plan.steptime import local_params, rank_layers


@dataclass(frozen=True)
class SearchSpace:
    """What the search varies; every other key stays as the base config has it."""

    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    """Micro-batch sizes tried (those that divide the batch per data rank)."""
    recompute: tuple[str, ...] = ("none", "selective", "full")
    """Activation recomputation modes tried."""
    float8: tuple[bool, ...] = (False, True)
    """float8 block linears (only without tp, on devices with float8 math)."""
    compile: tuple[bool, ...] = (True,)
    """torch.compile per block (whole model where the layout allows it, see `compile_scope`)."""
    sequence_parallel: tuple[bool, ...] = (True, False)
    """With tp > 1."""
    vpp: tuple[int, ...] = (1, 2)
    """Virtual pipeline stages per rank (with pp > 1)."""
    schedules: tuple[str, ...] = ("1f1b", "interleaved-1f1b", "zero-bubble", "gpipe")
    """Pipeline schedules tried (each where it applies)."""
    max_cp: int = 16
    """Largest context-parallel degree tried."""
    max_pp: int = 64
    """Largest pipeline degree tried."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _data_layouts(rest: int) -> Iterator[dict]:
    """The ways to spend `rest` data-parallel ranks: every dp x fsdp split (DDP, FSDP, HSDP), with each ZeRO
    stage where an fsdp dimension exists; `validate_layout` keeps the ones the trainer runs (ZeRO-1 only
    alone, ...)."""
    for fsdp in _divisors(rest):
        for zero in ((3, 2, 1) if fsdp > 1 else (3,)):
            yield {"dp": rest // fsdp, "fsdp": fsdp, "zero": zero}


def candidates(base: Config, world: int, space: SearchSpace, gpus_per_node: int,
               fp8_ok: bool = True) -> Iterator[Config]:
    """Every combination of the space on `world` ranks, valid or not (tp within a node)."""
    for tp in [d for d in _divisors(world) if d <= gpus_per_node]:
        for cp in [d for d in _divisors(world // tp) if d <= space.max_cp]:
            for pp in [d for d in _divisors(world // (tp * cp)) if d <= space.max_pp]:
                rest = world // (tp * cp * pp)
                pipes = [(1, "1f1b")] if pp == 1 else [(v, s) for v in space.vpp for s in space.schedules]
                for vpp, schedule in pipes:
                    for data in _data_layouts(rest):
                        for mb in space.micro_batches:
                            for sp in (space.sequence_parallel if tp > 1 else (True,)):
                                for rc in space.recompute:
                                    for f8 in (space.float8 if tp == 1 and fp8_ok else (False,)):
                                        for comp in space.compile:
                                            yield make_candidate(base, tp, cp, pp, vpp, schedule, data, mb, sp, rc, f8,
                                                        comp)


def make_candidate(base: Config, tp: int, cp: int, pp: int, vpp: int, schedule: str, data: dict, mb: int, sp: bool,
                   rc: str, f8: bool, comp: bool) -> Config:
    """`base` with one point of the space set (data: {"dp", "fsdp", "zero"}); FSDP layouts get bf16 parameters,
    compile covers the whole model where `validate_layout` allows it."""
    stages, n_layers = pp * vpp, base.model.n_layers
    uneven = stages > 1 and n_layers % stages and n_layers >= stages  # balanced, the later stages one block short
    pp_layers = [n_layers // stages + (i < n_layers % stages) for i in range(stages)] if uneven else None
    par = dataclasses.replace(base.parallel, tp=tp, cp=cp, pp=pp, vpp=vpp, pp_schedule=schedule, dp=data["dp"],
                              fsdp=data["fsdp"], zero=data["zero"], sequence_parallel=sp, pp_microbatches=0,
                              pp_layers=pp_layers, hierarchical_allreduce=False, param_dtype="fp32")
    if data_parallel_strategy(par) == "fsdp":
        par = dataclasses.replace(par, param_dtype="bf16")
    scope = "model" if comp and pp == 1 and tp == 1 and cp == 1 and data["fsdp"] == 1 else "blocks"
    compute = dataclasses.replace(base.compute, recompute=rc, compile=comp, compile_scope=scope)
    return dataclasses.replace(base, parallel=par, compute=compute, quant=dataclasses.replace(base.quant, float8=f8),
                               train=dataclasses.replace(base.train, micro_batch=mb))


def enumerate_layouts(base: Config, world: int, space: SearchSpace, gpus_per_node: int,
                      fp8_ok: bool = True) -> list[Config]:
    """The valid candidates, in enumeration order. The base config's ranges are checked once (a candidate
    only sets keys to values inside their ranges); each candidate's layout rules are checked in full."""
    validate(base)
    out = []
    for cfg in candidates(base, world, space, gpus_per_node, fp8_ok):
        try:
            validate_layout(cfg, world)
        except (LayoutError, ConfigError):
            continue
        out.append(cfg)
    return out


@dataclass
class Ranked:
    """One planned layout: its config and prediction."""

    cfg: Config
    prediction: Prediction


def state_bytes(cfg: Config) -> float:
    """A quick lower bound on one rank's bytes: fp32 parameters, gradients and AdamW state, sharded as the
    layout shards them (the largest pipeline rank)."""
    p = cfg.parallel
    local = local_params(cfg)
    shards = p.fsdp * p.cp if p.fsdp * p.cp > 1 else (p.dp if p.tp > 1 else 1)
    if p.fsdp > 1 and p.zero == 1 and p.tp == 1 and p.cp == 1 and p.dp == 1:
        return local * 8 + local * 8 / p.fsdp
    return local * 16 / shards


def activation_floor(cfg: Config) -> float:
    """A quick lower bound on one rank's activations: the fp32 residual stream every block keeps (whatever the
    recompute mode) and, unless blocks are fully recomputed, q, k, v, the attention output and the two MLP
    projections each block keeps in bf16 at least (compiled or not), for the micro-batches the first
    pipeline stage holds at once (1: no pipeline; every micro-batch under GPipe; up to pp under 1F1B)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    tokens = t.micro_batch * t.seq_len / p.cp
    norm_tokens = tokens / (p.tp if p.tp > 1 and p.sequence_parallel else 1)
    layers = max(sum(chunks) for chunks in rank_layers(cfg))
    per_block = norm_tokens * m.dim * 4
    if cfg.compute.recompute != "full":
        width = (2 * m.n_heads + 2 * m.n_kv_heads) * m.head_dim + 2 * m.ffn_dim
        per_block += tokens * width / p.tp * 2
    n_micro = grad_accumulation_steps(cfg)
    in_flight = 1 if p.pp == 1 else (n_micro if p.pp_schedule == "gpipe" else min(n_micro, p.pp))
    return layers * per_block * in_flight


def rank_layouts(base: Config, world: int, hw: Hardware, device: str, gpus_per_node: int, interconnect: str,
                 top: int = 10, space: SearchSpace | None = None, max_memory_checks: int = 2000,
                 ) -> tuple[list[Ranked], int, int]:
    """(the `top` fastest layouts that fit, fastest first; layouts enumerated; layouts checked for memory).

    Step time is predicted for every valid layout; the memory model (the costly part) runs in order of
    predicted speed until `top` layouts fit or `max_memory_checks` were tried."""
    space = space or SearchSpace()
    dev = hw.device(device)
    layouts = enumerate_layouts(base, world, space, gpus_per_node, fp8_ok=dev.flops("fp8") > 0)
    timed = []
    for index, cfg in enumerate(layouts):
        pred = predict(cfg, world, hw, device, gpus_per_node, interconnect, memory=False)
        timed.append((pred.step.seconds, index, cfg))
    timed.sort(key=lambda x: (x[0], x[1]))
    fitting: list[Ranked] = []
    checked = 0
    for _, _, cfg in timed:
        if len(fitting) >= top or checked >= max_memory_checks:
            break
        if state_bytes(cfg) + activation_floor(cfg) > dev.memory_bytes:  # cannot fit, whatever the rest
            continue
        checked += 1
        pred = predict(cfg, world, hw, device, gpus_per_node, interconnect)
        if pred.fits:
            fitting.append(Ranked(cfg, pred))
    return fitting, len(layouts), checked
