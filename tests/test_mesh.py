"""Impossible parallel layouts are refused before any process group exists, with a message naming the key.

Each case goes through the trainer's own entry (`Trainer(cfg, ...)`, which validates against torchrun's
WORLD_SIZE before `init_distributed`) and through the CLI (`fourfold.cli.main`), which must print one
error paragraph, exit with 2 and show no traceback. `init_distributed` is replaced by a tripwire so a
layout that wrongly passes validation fails the test instead of waiting for ranks that never come.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from fourfold.cli import main
from fourfold.errors import LayoutError
from fourfold.layout import grad_accumulation_steps, validate_layout
from fourfold.mesh import ParallelMesh
from tests.trainer_helpers import tiny_config

# name -> (world size, overrides, config keys the message must name). Base model: 4 layers, 4 heads,
# 2 kv heads, ffn 64, vocab 320; global batch 8, micro batch 2, seq_len 16.
INVALID = {
    "world-not-divisible": (3, {"parallel.fsdp": 2}, ["parallel.pp * dp * fsdp * cp * tp", "--parallel.fsdp 3"]),
    "product-too-large": (4, {"parallel.fsdp": 2, "parallel.tp": 2, "parallel.dp": 2}, ["parallel.pp * dp * fsdp"]),
    "product-too-small": (8, {"parallel.tp": 2, "parallel.fsdp": 2}, ["parallel.pp * dp * fsdp * cp * tp"]),
    "tp-vs-heads": (3, {"parallel.tp": 3}, ["parallel.tp", "model.n_heads"]),
    "tp-vs-kv-heads": (4, {"parallel.tp": 4}, ["parallel.tp", "model.n_kv_heads"]),
    "tp-vs-ffn": (2, {"parallel.tp": 2, "model.ffn_dim": 65}, ["parallel.tp", "model.ffn_dim"]),
    "tp-vs-vocab": (2, {"parallel.tp": 2, "model.vocab_size": 321}, ["parallel.tp", "model.vocab_size"]),
    "sp-vs-seq": (2, {"parallel.tp": 2, "train.seq_len": 15}, ["train.seq_len", "parallel.sequence_parallel"]),
    "cp-vs-seq": (3, {"parallel.cp": 3}, ["train.seq_len"]),
    "param-dtype-under-ddp": (2, {"parallel.dp": 2, "parallel.param_dtype": "bf16"}, ["parallel.param_dtype", "DDP"]),
    "reduce-dtype-one-rank": (1, {"parallel.reduce_dtype": "bf16"}, ["reduce_dtype", "a single data rank"]),
    "reduce-dtype-hierarchical": (4, {"parallel.dp": 4, "parallel.reduce_dtype": "bf16",
                                      "parallel.hierarchical_allreduce": True, "parallel.gpus_per_node": 2},
                                  ["reduce_dtype", "hierarchical"]),
    "cp-half-chunks": (4, {"parallel.cp": 4, "train.seq_len": 20}, ["train.seq_len"]),
    "pp-more-than-layers": (8, {"parallel.pp": 8}, ["model.n_layers", "parallel.pp"]),
    "pp-vpp-more-than-layers": (4, {"parallel.pp": 4, "parallel.vpp": 2, "parallel.pp_schedule": "interleaved-1f1b"},
                                ["model.n_layers", "parallel.vpp"]),
    "vpp-needs-interleaved": (2, {"parallel.pp": 2, "parallel.vpp": 2}, ["parallel.pp_schedule", "parallel.vpp"]),
    "vpp-without-pp": (1, {"parallel.vpp": 2, "parallel.pp_schedule": "interleaved-1f1b"},
                       ["parallel.vpp", "parallel.pp"]),
    "interleaved-needs-vpp": (2, {"parallel.pp": 2, "parallel.pp_schedule": "interleaved-1f1b"}, ["parallel.vpp"]),
    "zero-bubble-vpp-microbatches": (4, {"parallel.pp": 4, "parallel.vpp": 2, "parallel.pp_schedule": "zero-bubble",
                                         "model.n_layers": 8, "train.global_batch": 12},
                                     ["train.global_batch", "train.micro_batch"]),
    "pp-tied-embeddings": (2, {"parallel.pp": 2, "model.tie_embeddings": True},
                           ["model.tie_embeddings", "parallel.pp"]),
    "batch-vs-micro": (1, {"train.micro_batch": 3}, ["train.global_batch", "train.micro_batch"]),
    "batch-vs-data-ranks": (8, {"parallel.fsdp": 8}, ["train.global_batch", "train.micro_batch"]),
    "whole-model-compile-fsdp": (2, {"parallel.fsdp": 2, "compute.compile": True, "compute.compile_scope": "model"},
                                 ["compute.compile_scope", "blocks"]),
    "pp-microbatches": (2, {"parallel.pp": 2, "parallel.pp_microbatches": 3}, ["parallel.pp_microbatches"]),
    "interleaved-microbatches": (4, {"parallel.pp": 4, "parallel.pp_schedule": "interleaved-1f1b",
                                     "train.global_batch": 6}, ["train.global_batch", "train.micro_batch"]),
}


@pytest.fixture
def no_process_group(monkeypatch):
    """Pretend to be rank 0 of a torchrun world; fail loudly if the trainer gets as far as init."""

    def launch(world: int):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")

    def tripwire(*args, **kwargs):
        raise AssertionError("the layout passed validation and the trainer went on to init_distributed")

    monkeypatch.setattr("fourfold.train.trainer.init_distributed", tripwire)
    assert not dist.is_initialized()
    return launch


@pytest.mark.parametrize("name", list(INVALID))
def test_trainer_refuses_layout_before_init(name, tmp_path, no_process_group):
    from fourfold.train.trainer import Trainer

    world, overrides, keys = INVALID[name]
    cfg = tiny_config(tmp_path, **overrides)
    no_process_group(world)
    with pytest.raises(LayoutError) as err:
        Trainer(cfg, tmp_path / "run")
    message = str(err.value)
    for key in keys:
        assert key in message, f"{name}: {key!r} not in {message!r}"
    assert not dist.is_initialized()
    assert not (tmp_path / "run").exists()  # nothing written for a run that cannot start


@pytest.mark.parametrize("name", ["world-not-divisible", "tp-vs-kv-heads", "cp-vs-seq", "pp-more-than-layers",
                                  "vpp-without-pp", "interleaved-needs-vpp", "batch-vs-micro"])
def test_cli_reports_layout_error_without_traceback(name, tmp_path, capsys, no_process_group):
    world, overrides, keys = INVALID[name]
    base = tiny_config(tmp_path)  # writes the corpus; the CLI gets the same settings as flags
    flags = {"data.path": base.data.path, "data.cache_dir": base.data.cache_dir, "compute.device": "cpu",
             "train.global_batch": 8, "train.micro_batch": 2, "train.seq_len": 16, "log.progress": False,
             "model.dim": 32, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 2,
             "model.ffn_dim": 64, "model.vocab_size": 320, "model.max_seq_len": 64, **overrides}
    argv = ["train", "--out", str(tmp_path / "run")]
    for key, value in flags.items():
        argv += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    no_process_group(world)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert captured.err.startswith("error: ")
    for key in keys:
        assert key in captured.err, f"{name}: {key!r} not in {captured.err!r}"
    assert not dist.is_initialized()


def test_valid_layouts_pass_and_coordinates_are_row_major(tmp_path):
    cfg = tiny_config(tmp_path, **{"parallel.pp": 2, "parallel.fsdp": 2, "parallel.tp": 2})
    validate_layout(cfg, 8)
    assert grad_accumulation_steps(cfg) == 2
    mesh = ParallelMesh(sizes={"pp": 2, "dp": 1, "fsdp": 2, "cp": 1, "tp": 2}, world_size=8)
    # tp is fastest, pp slowest: rank 5 = pp 1, fsdp 0, tp 1.
    assert mesh.coords_of(5) == {"pp": 1, "dp": 0, "fsdp": 0, "cp": 0, "tp": 1}
    assert [mesh.coords_of(r)["tp"] for r in range(4)] == [0, 1, 0, 1]


def test_multi_rank_layout_without_process_group_is_refused(tmp_path):
    cfg = tiny_config(tmp_path, **{"parallel.fsdp": 2})
    with pytest.raises(LayoutError, match="torch.distributed initialised"):
        ParallelMesh.build(cfg, world_size=2, rank=0)
    assert not dist.is_initialized()
