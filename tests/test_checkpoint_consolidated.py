"""Whole-model tools: read_model_tensors assembles full tensors from a checkpoint sharded by 2 ranks (FSDP),
consolidate writes one safetensors file that safetensors itself reads, load_checkpoint / fourfold generate /
checkpoint.init_from load it (the same logits as the sharded original; under tensor parallel the same first
loss as in one process), it carries no optimizer state or data position and says so, and shard_consolidated
puts it back into a run directory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fourfold.checkpoint.consolidated import consolidate, read_model_tensors, shard_consolidated, \
    write_consolidated
from fourfold.checkpoint.store import load_checkpoint
from fourfold.errors import CheckpointError
from fourfold.infer.generate import load_for_inference
from fourfold.models.llama import Llama
from fourfold.train.metrics import read_metrics
from fourfold.train.trainer import Trainer, train
from tests.distributed.launcher import run_ranks
from tests.trainer_helpers import tiny_config


def _cfg(tmp: Path, **extra):
    return tiny_config(tmp, **{"compute.precision": "fp64", "train.steps": 2, **extra})


def _train_on_rank(rank: int, world: int, tmp: str, overrides: dict, run: str) -> None:
    train(_cfg(Path(tmp), **overrides), Path(tmp) / run)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A 2-step run under fsdp=2 (each rank wrote its own shard file) and its consolidated model."""
    tmp = tmp_path_factory.mktemp("consolidated")
    (tmp / "fsdp2").mkdir()
    (tmp / "fsdp2" / "tokenizer.json").write_text("{}")  # stands for the tokenizer files a checkpoint carries
    run_ranks(_train_on_rank, 2, args=(str(tmp), {"parallel.fsdp": 2}, "fsdp2"))
    ckpt = tmp / "fsdp2" / "checkpoints" / "step_2"
    (ckpt / "tokenizer.json").write_text("{}")
    out = consolidate(ckpt, tmp / "model")
    return tmp, ckpt, out


def _logits(model: Llama) -> torch.Tensor:
    return model(torch.arange(12).view(2, 6) % 300)


def test_consolidated_file_holds_every_model_tensor_whole(sharded):
    tmp, ckpt, out = sharded
    assert sorted(p.name for p in ckpt.glob("model-*.safetensors")) == ["model-00000.safetensors",
                                                                         "model-00001.safetensors"]
    config, tensors = read_model_tensors(ckpt)
    model = Llama(_cfg(tmp).model).double()
    assert set(tensors) == set(model.state_dict()) and config["parallel"]["fsdp"] == 2
    on_disk = load_file(str(out / "model.safetensors"))
    assert on_disk.keys() == tensors.keys() and all(torch.equal(on_disk[k], tensors[k]) for k in tensors)
    assert (out / "tokenizer.json").read_text() == "{}"


def test_consolidated_model_loads_with_the_logits_of_the_sharded_one(sharded):
    tmp, ckpt, out = sharded
    from_shards, from_file = Llama(_cfg(tmp).model).double(), Llama(_cfg(tmp).model).double()
    load_checkpoint(ckpt, from_shards)
    load_checkpoint(out, from_file)
    assert torch.equal(_logits(from_shards), _logits(from_file))
    generated, _ = load_for_inference(out, torch.device("cpu"))
    torch.testing.assert_close(_logits(generated.double()), _logits(from_file), rtol=1e-5, atol=1e-6)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_checkpoint(out, from_file, torch.optim.AdamW(from_file.parameters()))


def test_a_consolidated_model_cannot_be_resumed_but_can_start_a_run(sharded, tmp_path):
    tmp, _, out = sharded
    run = tmp_path / "run"
    assert shard_consolidated(out, run) == run / "checkpoints" / "step_0"
    with pytest.raises(CheckpointError, match="no 'data' entry.*init_from"):
        Trainer(_cfg(tmp), run, resume=True)
    trainer = Trainer(_cfg(tmp, **{"checkpoint.init_from": str(run)}), tmp_path / "init")
    _, tensors = read_model_tensors(out)
    got = trainer.runner.checkpoint_modules.state_dict()
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_init_from_a_consolidated_model_under_tensor_parallel(sharded, tmp_path):
    tmp, _, out = sharded
    overrides = {"checkpoint.init_from": str(out), "train.steps": 1}
    train(_cfg(tmp, **overrides), tmp_path / "single")
    run_ranks(_train_on_rank, 2, args=(str(tmp), {**overrides, "parallel.tp": 2}, str(tmp_path / "tp2")))
    first = [[r["loss"] for r in read_metrics(tmp_path / run) if "loss" in r] for run in ("single", "tp2")]
    torch.testing.assert_close(torch.tensor(first[1]), torch.tensor(first[0]), rtol=1e-9, atol=1e-12)


def test_write_consolidated_round_trip(tmp_path):
    tensors = {"w": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64), "s": torch.tensor(2.0)}
    write_consolidated(tmp_path / "m", {"model": {}}, tensors)
    config, back = read_model_tensors(tmp_path / "m")
    assert config == {"model": {}} and back.keys() == tensors.keys()
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())
