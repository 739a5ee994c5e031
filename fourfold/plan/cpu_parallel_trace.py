"""The ops of one rank's step of a parallel layout, traced on its own parallelised model with a fake process group.

    with fake_process_group(world_size=2):          # torch's fake backend: collectives return at once
        model = parallel_model(cfg, world_size)       # tp / cp / FSDP2 applied by fourfold.parallel, rank 0
    micro, optim = parallel_step_ops(cfg, world_size)  # (one micro-batch's ops, the clip and AdamW's ops)

Tensor parallel runs most of a block as DTensor ops (each pays DTensor's dispatch on top of its local
kernel), context parallel runs ring attention's own loop of block matmuls and merges, and FSDP2 adds its
copy-in/copy-out around each all-gather and reduce-scatter and steps AdamW over DTensor shards. None of that is
in the one-process model's trace (fourfold/plan/cpu_trace.py), so for these layouts the planner builds rank
0's model exactly as the trainer does (`fourfold.mesh.ParallelMesh`, `parallel.apply.apply_model_transforms`,
the data-parallel wrap), on fake tensors, over torch's fake process group
(`torch.testing._internal.distributed.fake_pg.FakeStore`, backend "fake": no peer, no data), and records every
op of a forward, loss, backward, clip and AdamW step. DTensor ops are recorded once, at the DTensor level, with
their local shards' sizes (`Op.dtensor`); collectives are recorded as such and priced by the layout's rules.
The fake group is the process's default group for the length of the trace, so this needs a process without
one (inside a distributed run `parallel_step_ops` raises RuntimeError and the caller keeps its estimate).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from fourfold.config import Config
from fourfold.layout import data_parallel_strategy
from fourfold.mesh import ParallelMesh
from fourfold.models.llama import Llama
from fourfold.ops.cross_entropy import cross_entropy
from fourfold.parallel.apply import apply_model_transforms
from fourfold.parallel.build import materialize
from fourfold.parallel.context import shard_batch
from fourfold.parallel.data_parallel import build_data_parallel
from fourfold.parallel.tensor import compute_loss, loss_context, settle_partial_grads
from fourfold.plan.cpu_trace import Op, OpRecorder
from fourfold.precision import master_dtype


def needs_parallel_trace(cfg: Config) -> bool:
    """Whether rank 0's step differs from the one-process model's beyond communication: tensor or context
    parallel, or FSDP2 (sharded parameters), without a pipeline (whose stages the one-process trace covers)."""
    p = cfg.parallel
    return p.pp == 1 and (p.tp > 1 or p.cp > 1 or data_parallel_strategy(p) == "fsdp")


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """torch's fake process group as the default group (rank 0 of `world_size`) for the length of the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group exists already: the parallel trace needs a process without one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def parallel_model(cfg: Config, world_size: int, fake: FakeTensorMode | None):
    """(rank 0's model, data-parallel strategy, mesh) as `fourfold.parallel.build.build_model` makes it, with
    storage from `fake` (fake tensors) or, with None, real tensors holding the initial weights."""
    mesh = ParallelMesh.build(cfg, world_size, 0)
    device = torch.device("cpu")
    dp = build_data_parallel(mesh, cfg.parallel, cfg.optim, device)
    with torch.device("meta"):
        model = Llama(cfg.model)
    model.to(dtype=master_dtype(cfg.compute.precision))
    model = apply_model_transforms(model, mesh, cfg.parallel, cfg.compute, cfg.quant, device)
    if dp.wraps_meta_models:
        model = dp.wrap(model)
    with fake or contextlib.nullcontext():
        if fake is None:
            materialize(model, cfg.model, dp.parameter_device, device, 0)
        else:
            model.to_empty(device=dp.parameter_device)  # no values: fake tensors carry none
    if not dp.wraps_meta_models:
        model = dp.wrap(model)
    return model, dp, mesh


def step_function(cfg: Config, model, dp, mesh, fake: FakeTensorMode | None):
    """A function running one micro-batch's forward, loss and backward, and one running the clip and AdamW
    (the first optimizer step already taken, so that AdamW's state exists), as the plain step runner does."""
    t, p = cfg.train, cfg.parallel
    with fake or contextlib.nullcontext():
        optimizer = dp.build_optimizer(model)
        inputs = torch.randint(0, cfg.model.vocab_size, (t.micro_batch, t.seq_len))
        targets = torch.randint(0, cfg.model.vocab_size, (t.micro_batch, t.seq_len))
    positions = None
    if p.cp > 1:
        with fake or contextlib.nullcontext():
            inputs, targets, positions = shard_batch(inputs, targets, mesh.coord("cp"), p.cp)
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.compute.precision)
    tokens = inputs.numel()

    def micro_batch():
        with loss_context(p.tp > 1):
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                logits = model(inputs, positions)
            if p.tp > 1:
                loss = compute_loss(logits, targets, reduction="sum") / tokens
            else:
                loss = cross_entropy(logits, targets, chunk=cfg.compute.loss_chunk, reduction="sum") / tokens
            loss.backward()

    def optimizer_step():
        if p.tp > 1:  # the step runner's own: Partial gradients (norm weights under sequence parallel) reduced
            settle_partial_grads(list(model.parameters()))
        dp.clip_grad_norm(model, cfg.optim.grad_clip, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return micro_batch, optimizer_step


_TRACES: dict[tuple, tuple[tuple[Op, ...], tuple[Op, ...]]] = {}


def parallel_step_ops(cfg: Config, world_size: int) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """(the ops of one micro-batch's forward, loss and backward; the ops of the clip and AdamW step) of rank 0
    of `cfg` on `world_size` ranks, traced on its parallelised model (cached by the config's shape and layout)."""
    if dist.is_initialized():  # the same answer whether or not this shape was traced before
        raise RuntimeError("a process group exists already: the parallel trace needs a process without one")
    key = (repr(cfg.model), repr(cfg.parallel), cfg.train.micro_batch, cfg.train.seq_len, cfg.compute.precision,
           cfg.compute.recompute, cfg.compute.loss_chunk, cfg.optim.grad_clip, world_size)
    if key not in _TRACES:
        with fake_process_group(world_size):
            traced = trace_in_group(cfg, world_size)
        if len(_TRACES) >= 64:
            _TRACES.pop(next(iter(_TRACES)))
        _TRACES[key] = traced
    return _TRACES[key]


def trace_in_group(cfg: Config, world_size: int) -> tuple[tuple[Op, ...], tuple[Op, ...]]:
    """`parallel_step_ops` inside a (fake) default process group of `world_size` ranks that exists already."""
    cfg = replace(cfg, compute=replace(cfg.compute, compile=False))  # the eager step: what runs on CPUs
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model, dp, mesh = parallel_model(cfg, world_size, fake)
    micro_batch, optimizer_step = step_function(cfg, model, dp, mesh, fake)
    with fake:  # AdamW's state exists from the first step on: take one on zero gradients, record the next
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        optimizer_step()
    micro, optim = OpRecorder(), OpRecorder()
    with fake, micro:
        micro_batch()
    with fake, optim:
        optimizer_step()
    return tuple(micro.ops), tuple(optim.ops)
