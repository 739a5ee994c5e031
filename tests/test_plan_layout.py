"""The planner derives each rank's parameters from the code that builds them, and shares FSDP's policies with it.

Every rank of a layout is built for real over torch's fake process group (collectives do nothing, shapes
and sharding are exactly those of a real run), each rank in a forked child so no torch state of one
simulated rank (torch keeps DTensor meshes across process groups in one process) leaks into the next: the parameters it stores (FSDP2 padding
included), their local (unpadded) bytes, their names in order and their tensor-parallel shapes must equal
what `fourfold.plan` derives from the meta-device model. A 405B preset is planned without allocating it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import resource

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from fourfold.config import ParallelConfig, build_config
from fourfold.mesh import ParallelMesh
from fourfold.models.llama import Llama
from fourfold.parallel.build import build_model
from fourfold.parallel.data_parallel import build_data_parallel
from fourfold.parallel.fsdp import (apply_fsdp, block_reshards_after_forward, fsdp_dtypes, mixed_precision,
                                    prefetch_depth, reshards_after_forward)
from fourfold.parallel.pipeline.split import split_pipeline
from fourfold.plan import layout as plan_layout
from fourfold.plan.layout import meta_model, rank_chunks, rank_coordinates
from fourfold.plan.memory import estimate_memory

# Vocabulary 322 and MLP width 98 do not divide by 4: FSDP2 pads some ranks' shards.
TINY = {"model.dim": 64, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_dim": 98,
        "model.vocab_size": 322, "model.max_seq_len": 32, "train.seq_len": 32, "train.micro_batch": 1,
        "train.global_batch": 8, "compute.device": "cpu"}
LAYOUTS = {
    "single": (1, {}),
    "fsdp4-padded": (4, {"parallel.fsdp": 4}),
    "zero1": (2, {"parallel.fsdp": 2, "parallel.zero": 1}),
    "hsdp": (4, {"parallel.dp": 2, "parallel.fsdp": 2}),
    "cp2": (2, {"parallel.cp": 2}),
    "tp2": (2, {"parallel.tp": 2}),
    "tp2-tied-no-sp": (2, {"parallel.tp": 2, "parallel.sequence_parallel": False, "model.tie_embeddings": True}),
    "pp2": (2, {"parallel.pp": 2}),
    "pp2-vpp2-fsdp2": (4, {"parallel.pp": 2, "parallel.vpp": 2, "parallel.pp_schedule": "interleaved-1f1b",
                           "parallel.fsdp": 2}),
    "pp2-tp2-fsdp2": (8, {"parallel.pp": 2, "parallel.tp": 2, "parallel.fsdp": 2, "parallel.pp_layers": [1, 3]}),
}


def _cfg(**overrides):
    return build_config({}, {k: str(v) for k, v in {**TINY, **overrides}.items()})


@contextlib.contextmanager
def _fake_world(rank: int, world: int):
    """torch.distributed initialised as `rank` of `world` over the fake backend (no other processes)."""
    if world == 1:
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tp_shape(prm: torch.Tensor) -> tuple[int, ...]:
    """The parameter's shape after tensor parallel only (FSDP's shard dimension left whole)."""
    if not isinstance(prm, DTensor):
        return tuple(prm.shape)
    shape = list(prm.shape)
    for name, size, placement in zip(prm.device_mesh.mesh_dim_names, prm.device_mesh.shape, prm.placements):
        if name == "tp" and isinstance(placement, Shard):
            shape[placement.dim] //= size
    return tuple(shape)


def _built(cfg, world: int, rank: int) -> dict:
    """What rank `rank` of the real builder holds (built in a forked child): see `_build_in_this_process`."""
    if world == 1:
        return _build_in_this_process(cfg, world, rank)
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_build_and_send, args=(cfg, world, rank, send))
    child.start()
    send.close()
    status, result = receive.recv()
    child.join(timeout=30)
    assert status == "ok", f"rank {rank} of {world} failed to build:\n{result}"
    return result


def _build_and_send(cfg, world: int, rank: int, send) -> None:
    import traceback

    try:
        send.send(("ok", _build_in_this_process(cfg, world, rank)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        send.send(("error", traceback.format_exc()))


def _build_in_this_process(cfg, world: int, rank: int) -> dict:
    """What rank `rank` of the real builder holds: stored and local parameter bytes, names and tp shapes."""
    with _fake_world(rank, world):
        mesh = ParallelMesh.build(cfg, world, rank, "cpu")
        dp = build_data_parallel(mesh, cfg.parallel, cfg.optim, torch.device("cpu"))
        chunks = build_model(cfg.model, cfg.parallel, cfg.compute, cfg.quant, mesh, dp, torch.device("cpu"))
        named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]
        storages = {}
        for _, p in named:
            storage = _local(p).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return {"stored": sum(storages.values()),
                "local": sum(_local(p).numel() * _local(p).element_size() for _, p in named),
                "shapes": [(n.removeprefix("module."), _tp_shape(p)) for n, p in named]}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_derived_parameters_equal_the_built_and_sharded_model_on_every_rank(name):
    world, overrides = LAYOUTS[name]
    cfg = _cfg(**overrides)
    for rank in range(world):
        built = _built(cfg, world, rank)
        est = estimate_memory(cfg, world, rank)
        derived = [(prm.name, prm.shape) for chunk in rank_chunks(cfg, rank_coordinates(cfg, rank)["pp"])
                   for prm in chunk.params]
        assert derived == built["shapes"], f"{name} rank {rank}"
        assert est.params == built["stored"], f"{name} rank {rank}"
        assert est.params - est.param_padding == built["local"], f"{name} rank {rank}"


def test_a_split_that_takes_blocks_out_of_its_input_does_not_spoil_later_plans(monkeypatch):
    cfg = _cfg(**{**LAYOUTS["pp2"][1], "model.n_layers": 6})  # a model no other test has cached
    expected = [[prm.name for prm in chunk.params] for rank in (0, 1) for chunk in rank_chunks(cfg, rank)]
    plan_layout._META_MODELS.clear()

    def split_in_place(model, pp_rank, pp, vpp=1, layers_per_stage=None):
        chunks = split_pipeline(model, pp_rank, pp, vpp, layers_per_stage)
        for name in [n for n in model.layers.keys() if n not in chunks[0].layers]:
            del model.layers[name]
        return chunks

    monkeypatch.setattr(plan_layout, "split_pipeline", split_in_place)
    assert [[prm.name for prm in chunk.params] for rank in (0, 1) for chunk in rank_chunks(cfg, rank)] == expected


def test_a_405b_preset_is_planned_from_shapes_without_allocating_it():
    # Llama 3 405B's own layout (Table 4 of the Llama 3 paper): tp8 x pp16, first and last stage one block short.
    pp_layers = [7] + [8] * 14 + [7]
    cfg = build_config({}, {"model.preset": "llama3-405b", "parallel.tp": "8", "parallel.pp": "16",
                            "parallel.fsdp": "8", "parallel.pp_layers": str(pp_layers), "train.seq_len": "8192",
                            "train.micro_batch": "1", "train.global_batch": "64", "compute.device": "cuda",
                            "compute.precision": "bf16", "compute.recompute": "full"})
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    worst = estimate_memory(cfg, 1024)
    middle = estimate_memory(cfg, 1024, rank=64 * 3)  # pp stage 3: eight blocks, no embedding or head
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024  # ru_maxrss is KiB on Linux
    assert grown_mib < 512  # the fp32 model would be 1.6 TB

    m, tp, fsdp = cfg.model, 8, 8
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    matrices = m.dim * (q + 2 * kv) + q * m.dim + 3 * m.dim * m.ffn_dim
    whole = m.n_layers * (matrices + 2 * m.dim) + 2 * m.vocab_size * m.dim + m.dim  # blocks, embedding, head, norm
    assert sum(p.numel() for p in meta_model(m).parameters()) == whole == 405_853_388_800
    block = matrices // tp + 2 * m.dim  # per tp rank: matrices split, norms replicated
    assert middle.params == 8 * block // fsdp * 4  # every dim 0 divides by 8: no padding
    assert worst.total >= middle.total and worst.rank == 0  # the first stage holds the most micro-batches


def _fsdp_blocks(p: ParallelConfig, master: torch.dtype = torch.float32) -> Llama:
    """A tiny model sharded by apply_fsdp over a fake 2-rank world, after one forward."""
    torch.manual_seed(0)
    model = Llama(_cfg().model).to(master)
    apply_fsdp(model, init_device_mesh("cpu", (2,)), p)
    model(torch.zeros(1, 8, dtype=torch.long))
    return model


@pytest.mark.parametrize("overrides", [{"fsdp": 2}, {"fsdp": 2, "zero": 2}, {"fsdp": 2, "reshard_after_forward": False}])
def test_apply_fsdp_keeps_gathered_after_forward_exactly_the_blocks_the_policy_names(overrides):
    p = ParallelConfig(**overrides)
    with _fake_world(0, 2):
        model = _fsdp_blocks(p)
        # A resharded block holds DTensor shards again; a block kept gathered holds plain unsharded tensors.
        gathered = [not isinstance(block.attention.wq.weight, DTensor) for block in model.layers.values()]
    assert gathered == [not block_reshards_after_forward(p, i, 4) for i in range(4)]
    assert gathered == ([False, False, False, True] if reshards_after_forward(p) else [True] * 4)


def test_fsdp_policies_used_by_the_builder_and_the_planner():
    assert reshards_after_forward(ParallelConfig(fsdp=2, zero=3))
    assert not reshards_after_forward(ParallelConfig(fsdp=2, zero=2))
    assert reshards_after_forward(ParallelConfig(tp=2, zero=2))  # zero 2 is about fsdp > 1 only
    assert prefetch_depth(ParallelConfig(prefetch=3, max_inflight_allgathers=2)) == 2
    assert prefetch_depth(ParallelConfig(prefetch=-1)) == 0
    f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64
    assert fsdp_dtypes(ParallelConfig(), f64) == (f64, f64)  # "fp32" is full precision: float64 runs stay float64
    # bf16 parameters with the default reduce dtype reduce in fp32, as parallel.reduce_dtype says
    assert fsdp_dtypes(ParallelConfig(param_dtype="bf16"), f32) == (bf16, f32)
    assert mixed_precision(ParallelConfig(param_dtype="bf16"), f32) == MixedPrecisionPolicy(bf16, f32)
    assert mixed_precision(ParallelConfig(), f32) == MixedPrecisionPolicy(None, None)
    assert mixed_precision(ParallelConfig(reduce_dtype="bf16"), f32) == MixedPrecisionPolicy(None, bf16)
    assert mixed_precision(ParallelConfig(param_dtype="bf16", reduce_dtype="bf16"), f32) == MixedPrecisionPolicy(bf16)


def test_the_memory_model_keeps_one_block_gathered_per_pipeline_chunk():
    cfg = _cfg(**LAYOUTS["pp2-vpp2-fsdp2"][1])
    chunks = rank_chunks(cfg, 0)
    block = sum(prm.numel for prm in chunks[0].params if prm.unit == 0)
    root = sum(prm.numel for chunk in chunks for prm in chunk.params if prm.unit is None)
    # apply_fsdp runs once per chunk, so each chunk's last block stays gathered; one more is prefetched.
    kept = len(chunks) * block
    gathered = estimate_memory(cfg, 4, rank=0).breakdown["fsdp_gathered"]
    assert gathered == (root + kept + prefetch_depth(cfg.parallel) * block) * 4
