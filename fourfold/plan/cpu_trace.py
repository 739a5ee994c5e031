"""The ops one rank's training step issues, found by running it on fake tensors: the CPU step model's inventory.

    ops = micro_batch_ops(cfg, layers=4, first=True, last=True)   # forward, loss, backward of one micro-batch
    ops = optimizer_ops(shapes, foreach=True)                        # the gradient clip and AdamW's step

fourfold's own model (`fourfold.models.llama.Llama`), loss (`fourfold.ops.cross_entropy`), clip
(`fourfold.parallel.grad_norm`) and optimizer (`fourfold.optim.build_adamw`) run under torch's
FakeTensorMode on fake CPU tensors of the rank's local shapes (tensor parallel splits heads, kv heads, ffn and
vocabulary; context parallel the sequence; the pipeline the blocks), so the same CPU kernels are chosen and no
memory or time is spent. A dispatch mode records every aten op below autograd with its FLOPs (GEMMs, the
attention kernel) or the bytes it reads and writes; `tests/test_plan_cpu.py` checks the count against a real
step on real tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _resolve_process_group
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from fourfold.config import Config, ModelConfig
from fourfold.models.llama import Llama
from fourfold.ops.cross_entropy import cross_entropy
from fourfold.optim import adamw_kwargs
from fourfold.parallel.grad_norm import clip_with_norm, total_grad_norm

COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd"}
COLLECTIVE_KINDS = {"all_reduce": "all_reduce", "allreduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
                    "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
                    "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
                    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "broadcast_": "broadcast",
                    "broadcast": "broadcast", "send": "p2p"}
"""Process-group calls by the gloo operation they are priced as (fourfold.plan.cpu_costs.COLLECTIVES); the size
is the largest tensor the call touches (the gathered output, the scattered input, the message). A ring's
receive pairs with its send and waits are no call of their own: not counted."""
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}
ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu": False,
             "_scaled_dot_product_flash_attention_for_cpu_backward": True}
NO_DATA = {"detach", "_local_scalar_dense", "lift_fresh", "promote_types", "_record_function_enter_new",
           "_record_function_exit", "alias", "empty", "empty_like", "_unsafe_view", "view", "t", "transpose",
           "expand", "unsqueeze", "squeeze", "slice", "select", "permute", "as_strided", "split", "split_with_sizes",
           "unbind", "chunk", "view_as_real", "view_as_complex", "_reshape_alias", "unflatten", "flatten", "reshape"}


@dataclass(frozen=True)
class Op:
    """One dispatched aten op: its name, class, FLOPs (GEMMs, attention), bytes moved, tensors (foreach), phase."""

    name: str
    kind: str
    """'matmul', 'attention', 'foreach', 'view' (moves no data), 'collective' (a process-group call: priced by the
    layout's rules) or 'elementwise' (everything else)."""
    flops: float = 0.0
    nbytes: float = 0.0
    tensors: int = 1
    """Tensors of a foreach op; ranks of a collective's group."""
    backward: bool = False
    """Issued by the autograd engine (or the attention backward kernel)."""
    dtensor: bool = False
    """Dispatched on DTensors (tensor parallel, FSDP2's sharded parameters): sizes are the local shards', and the
    op pays DTensor's dispatch (sharding propagation, wrapping) on top of its local kernel."""


def _tensors(tree) -> list[torch.Tensor]:
    out = []
    for x in tree:
        if isinstance(x, torch.Tensor):
            out.append(x._local_tensor if isinstance(x, DTensor) else x)
        elif isinstance(x, (list, tuple)):
            out += _tensors(x)
    return out


def _nbytes(tensors) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors))


def _group_size(args, kwargs) -> int:
    """The ranks of the process group a collective's arguments name (a group object, a group name or size)."""
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, dist.ProcessGroup):
            return a.size()
        if isinstance(a, str):
            try:
                return _resolve_process_group(a).size()
            except Exception:  # not a group's name
                continue
    return 2


class OpRecorder(TorchDispatchMode):
    """Records every aten op that reaches the dispatcher below autograd (also usable on real tensors)."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []
        self.backward = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        namespace, name = func.namespace, func.overloadpacket.__name__
        if namespace == "prim":  # fake tensors' own device queries
            return out
        dtensor = any(issubclass(t, DTensor) for t in types)
        if namespace in COLLECTIVE_NAMESPACES:  # priced at gloo's alpha-beta (fourfold.plan.cpu_costs), not as data
            kind = COLLECTIVE_KINDS.get(name)
            if kind:
                tensors = _tensors(list(args) + list(kwargs.values()))
                nbytes = max(t.numel() * t.element_size() for t in tensors) if tensors else 0.0
                self.ops.append(Op(kind, "collective", nbytes=float(nbytes), tensors=_group_size(args, kwargs),
                                   backward=self.backward or torch._C._current_graph_task_id() >= 0))
            return out
        ins = _tensors(list(args) + list(kwargs.values()))
        outs = _tensors([out] if not isinstance(out, (list, tuple)) else list(out))
        if name in MATMULS:
            a, b = ins[-2], ins[-1]
            op = Op(name, "matmul", flops=2.0 * a.numel() * b.shape[-1])
        elif name in ATTENTION:
            q, k = (ins[1], ins[2]) if ATTENTION[name] else (ins[0], ins[1])  # (b, h, s, d): causal QK^T and PV
            op = Op(name, "attention", flops=2.0 * q.numel() * k.shape[-2], backward=ATTENTION[name])
        elif name.startswith("_foreach"):
            first_list = next((a for a in args if isinstance(a, (list, tuple))), [])
            op = Op(name, "foreach", nbytes=_nbytes(ins) + _nbytes(outs), tensors=max(1, len(first_list)))
        elif name in NO_DATA or func.is_view:
            op = Op(name, "view")
        else:
            op = Op(name, "elementwise", nbytes=_nbytes(ins) + _nbytes(outs))
        self.ops.append(dataclasses.replace(op, dtensor=dtensor, backward=op.backward or self.backward or
                                            torch._C._current_graph_task_id() >= 0))
        return out


def local_model_config(cfg: Config) -> ModelConfig:
    """The model shape one tensor-parallel rank computes with: heads, kv heads, ffn and vocabulary split by tp."""
    m, tp = cfg.model, cfg.parallel.tp
    if tp == 1:
        return m
    return dataclasses.replace(m, n_heads=m.n_heads // tp, n_kv_heads=m.n_kv_heads // tp, ffn_dim=m.ffn_dim // tp,
                               vocab_size=m.vocab_size // tp, head_size=m.head_dim, preset=None)


_TRACES: dict[tuple, tuple[Op, ...]] = {}
"""Traces by everything they depend on (a layout search asks for the same shapes many times)."""


def _micro_batch_ops(model_cfg: ModelConfig, micro_batch: int, seq: int, layers: int, first: bool, last: bool,
                     precision: str, loss_chunk: int) -> tuple[Op, ...]:
    shape = dataclasses.replace(model_cfg, n_layers=max(1, layers), max_seq_len=max(model_cfg.max_seq_len, seq))
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model = Llama(shape)
        if layers == 0:
            model.layers = nn.ModuleDict()
        if not first:
            model.tok_embeddings = None
        if not last:
            model.norm, model.output = None, None
        if first:
            inputs = torch.randint(0, shape.vocab_size, (micro_batch, seq))
        else:
            inputs = torch.zeros(micro_batch, seq, shape.dim, requires_grad=True)
        targets = torch.randint(0, shape.vocab_size, (micro_batch, seq))
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    recorder = OpRecorder()
    with fake, recorder:
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = model(inputs)
        if last:
            loss = cross_entropy(out, targets, chunk=loss_chunk, reduction="sum") / (micro_batch * seq)
            loss.backward()
        else:
            out.backward(torch.ones_like(out))
    return tuple(recorder.ops)


def micro_batch_ops(cfg: Config, layers: int, first: bool, last: bool) -> tuple[Op, ...]:
    """The ops of one micro-batch's forward, loss (when `last`) and backward through `layers` blocks of this
    rank's local shape (with the embedding when `first`, the final norm and head when `last`)."""
    seq = cfg.train.seq_len // cfg.parallel.cp
    args = (local_model_config(cfg), cfg.train.micro_batch, seq, layers, first, last, cfg.compute.precision,
            cfg.compute.loss_chunk)
    key = (repr(args[0]),) + args[1:]
    if key not in _TRACES:
        if len(_TRACES) >= 256:
            _TRACES.pop(next(iter(_TRACES)))
        _TRACES[key] = _micro_batch_ops(*args)
    return _TRACES[key]


@functools.lru_cache(maxsize=256)
def optimizer_ops(shapes: tuple[tuple[int, ...], ...], foreach: bool, clip: bool) -> tuple[Op, ...]:
    """The ops of the gradient clip (when `clip`) and one AdamW step over parameters of `shapes` (fp32), as
    `fourfold.optim` builds it (foreach on CPUs; `foreach` False: the per-tensor loop ZeRO-1's optimizer runs)."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        params = [nn.Parameter(torch.zeros(s)) for s in shapes]
        for p in params:
            p.grad = torch.zeros_like(p)
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        kwargs = {**adamw_kwargs(_OptimDefaults(), torch.device("cpu")), "foreach": foreach}
        opt = torch.optim.AdamW([g for g in groups if g["params"]], **kwargs)
        opt.step()  # the state exists from the first step on: record a later one
    recorder = OpRecorder()
    with fake, recorder:
        if clip:
            norm = total_grad_norm(params)
            clip_with_norm(params, 1.0, norm)
        opt.step()
    return tuple(recorder.ops)


@dataclass
class _OptimDefaults:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8


def flops_of(ops: tuple[Op, ...], kind: str) -> float:
    """Sum of the FLOPs of the ops of `kind`."""
    return math.fsum(op.flops for op in ops if op.kind == kind)
