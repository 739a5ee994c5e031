"""Impossible parallel layouts are refused before any process group exists, with a message naming the key.

The table of invalid layouts goes straight to `fourfold.layout.validate_layout` (the one place for layout
rules). Around it: the trainer validates before `init_distributed` (one case, with a tripwire), the CLI
checks a layout against `--nproc N` before it launches torchrun (in this process, the launch replaced by a
tripwire), and one real `python -m fourfold train --nproc 2 ...` proves that at launch time the user sees
exit code 2 and one paragraph, not torchrun's traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from fourfold.cli import main
from fourfold.errors import LayoutError
from fourfold.layout import data_parallel_strategy, grad_accumulation_steps, validate_layout
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
    "zero1-with-tp": (4, {"parallel.fsdp": 2, "parallel.tp": 2, "parallel.zero": 1},
                      ["parallel.zero", "--parallel.zero 3", "ZeRO-3"]),
    "zero1-with-dp": (4, {"parallel.fsdp": 2, "parallel.dp": 2, "parallel.zero": 1}, ["parallel.zero", "parallel.dp"]),
    "zero1-with-cp": (4, {"parallel.fsdp": 2, "parallel.cp": 2, "parallel.zero": 1}, ["parallel.zero", "parallel.cp"]),
    "pp-uneven-split": (3, {"parallel.pp": 3}, ["model.n_layers", "parallel.pp_layers"]),
    "pp-layers-sum": (2, {"parallel.pp": 2, "parallel.pp_layers": "[1, 2]"}, ["parallel.pp_layers", "model.n_layers"]),
    "hierarchical-without-ddp": (2, {"parallel.fsdp": 2, "parallel.hierarchical_allreduce": True},
                                 ["parallel.hierarchical_allreduce", "--parallel.dp N"]),
    "cpu-offload-without-fsdp": (2, {"parallel.dp": 2, "parallel.cpu_offload": True},
                                 ["parallel.cpu_offload", "--parallel.fsdp N"]),
    "pp-layers-without-pp": (1, {"parallel.pp_layers": "[2, 2]"}, ["parallel.pp_layers", "parallel.pp"]),
    "pp-microbatches-without-pp": (1, {"parallel.pp_microbatches": 4}, ["parallel.pp_microbatches", "parallel.pp"]),
    "hierarchical-per-node": (4, {"parallel.dp": 4, "parallel.hierarchical_allreduce": True,
                                  "parallel.gpus_per_node": 3}, ["parallel.dp", "parallel.gpus_per_node"]),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_invalid_layout_is_refused_with_the_keys_to_change(name, tmp_path):
    world, overrides, keys = INVALID[name]
    cfg = tiny_config(tmp_path, **overrides)
    with pytest.raises(LayoutError) as err:
        validate_layout(cfg, world)
    message = str(err.value)
    for key in keys:
        assert key in message, f"{name}: {key!r} not in {message!r}"


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


def test_trainer_refuses_layout_before_init(tmp_path, no_process_group):
    """The trainer's own entry validates against torchrun's WORLD_SIZE before any process group or file."""
    from fourfold.train.trainer import Trainer

    world, overrides, keys = INVALID["tp-vs-kv-heads"]
    no_process_group(world)
    with pytest.raises(LayoutError, match="model.n_kv_heads"):
        Trainer(tiny_config(tmp_path, **overrides), tmp_path / "run")
    assert not dist.is_initialized()
    assert not (tmp_path / "run").exists()  # nothing written for a run that cannot start


def _cli_flags(tmp_path, overrides: dict) -> list[str]:
    base = tiny_config(tmp_path)  # writes the corpus; the CLI gets the same settings as flags
    flags = {"data.path": base.data.path, "data.cache_dir": base.data.cache_dir, "compute.device": "cpu",
             "train.global_batch": 8, "train.micro_batch": 2, "train.seq_len": 16, "log.progress": False,
             "model.dim": 32, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 2,
             "model.ffn_dim": 64, "model.vocab_size": 320, "model.max_seq_len": 64, **overrides}
    argv = []
    for key, value in flags.items():
        argv += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


@pytest.mark.parametrize("name", ["world-not-divisible", "tp-vs-kv-heads", "cp-vs-seq", "pp-more-than-layers",
                                  "vpp-without-pp", "interleaved-needs-vpp", "batch-vs-micro", "zero1-with-tp"])
def test_cli_checks_layout_against_nproc_before_launch(name, tmp_path, capsys, monkeypatch):
    world, overrides, keys = INVALID[name]
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)

    def tripwire(*args, **kwargs):
        raise AssertionError("the layout passed the CLI's check and went on to launch or train")

    monkeypatch.setattr("fourfold.cli.train._launch_torchrun", tripwire)
    monkeypatch.setattr("fourfold.train.trainer.train", tripwire)
    argv = ["train", "--out", str(tmp_path / "run"), "--nproc", str(world), *_cli_flags(tmp_path, overrides)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert captured.err.startswith("error: ")
    for key in keys:
        assert key in captured.err, f"{name}: {key!r} not in {captured.err!r}"
    assert not dist.is_initialized()
    assert not (tmp_path / "run").exists()


def test_launch_time_layout_error_is_one_paragraph_and_exit_2(tmp_path):
    """A real `python -m fourfold train --nproc 2` with tp=3: refused before torchrun starts any worker."""
    root = Path(__file__).resolve().parents[1]
    argv = [sys.executable, "-m", "fourfold", "train", "--nproc", "2", "--parallel.tp", "3",
            "--out", str(tmp_path / "run"), *_cli_flags(tmp_path, {})]
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=root, env=env)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
    assert "parallel.pp * dp * fsdp * cp * tp" in out.stderr and "--nproc 3" in out.stderr
    assert "torch.distributed" not in out.stderr  # torchrun never ran
    assert not (tmp_path / "run").exists()


def test_zero1_stays_zero1_where_it_can_run(tmp_path):
    """The refusal is only for layouts where ZeRO-1 would have become FSDP; plain fsdp keeps ZeRO-1."""
    cfg = tiny_config(tmp_path, **{"parallel.fsdp": 2, "parallel.zero": 1})
    validate_layout(cfg, 2)
    assert data_parallel_strategy(cfg.parallel) == "zero1"


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
