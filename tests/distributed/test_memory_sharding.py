"""Data-parallel sharding of parameters, gradients and optimizer state, measured against the prediction.

For plain dp (DDP), ZeRO-1 (DDP + ZeroRedundancyOptimizer), ZeRO-2 and FSDP (ZeRO-3, both FSDP2) on 2 and
4 gloo ranks, every rank builds the real Trainer, runs one optimizer step, and reports what it holds
(`DataParallel.memory_report`, the gradients just before `zero_grad`, and the storages behind them). Checked:
(a) sharded components are 1/N of the single-process figure within FSDP2's padding, unsharded ones are
equal; (b) they equal `estimate_memory(cfg, N, rank)` exactly, per rank.

The model's vocabulary (322) and MLP width (98) do not divide by 4, so on 4 ranks FSDP2 pads: every rank
stores ceil(dim0 / 4) rows per parameter, the last rank's local shard is shorter, and `memory_report`
(which counts `to_local()` elements) reports the unpadded size. The prediction models the padded storage
and says how much of it is padding, so report == predicted - param_padding holds exactly on every rank.
All strategies of one world size run in one spawn (several Trainers share the process group: the mesh
creates its sub-groups per Trainer), which keeps the file fast.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.launcher import run_ranks

MODEL = {"model.dim": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_dim": 98,
         "model.vocab_size": 322, "model.max_seq_len": 32}
STRATEGIES = {
    "dp": lambda n: {"parallel.dp": n},
    "zero1": lambda n: {"parallel.fsdp": n, "parallel.zero": 1},
    "zero2": lambda n: {"parallel.fsdp": n, "parallel.zero": 2},
    "fsdp": lambda n: {"parallel.fsdp": n, "parallel.zero": 3},
}


def _config(tmp: Path, world: int, strategy: str):
    """The tiny trainer config with `strategy` over `world` ranks (one micro-batch of 2 per rank)."""
    from tests.trainer_helpers import tiny_config

    return tiny_config(tmp, **{**MODEL, "train.seq_len": 16, "train.micro_batch": 2,
                               "train.global_batch": 2 * world, **STRATEGIES[strategy](world)})


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (what the allocator holds, FSDP2 padding included)."""
    storages = {}
    for t in tensors:
        s = _local(t).untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def _rank_main(rank: int, world: int, tmp: str) -> dict:
    """Every strategy on this world size: build the Trainer, one step, and what this rank holds."""
    import torch

    from fourfold.models.llama import Llama
    from fourfold.plan.memory import estimate_memory
    from fourfold.train.trainer import Trainer

    out = {}
    for name in STRATEGIES:
        cfg = _config(Path(tmp), world, name)
        trainer = Trainer(cfg, Path(tmp) / f"{name}-{world}")
        params = list(trainer.model.parameters())
        seen = {}
        zero_grad = trainer.optimizer.zero_grad

        def measure_then_zero(*args, _params=params, _seen=seen, _zero_grad=zero_grad, **kwargs):
            grads = [p.grad for p in _params if p.grad is not None]
            _seen["grad_bytes"] = sum(_local(g).numel() * _local(g).element_size() for g in grads)
            _seen["grad_storage"] = _storage_bytes(grads)
            return _zero_grad(*args, **kwargs)

        trainer.optimizer.zero_grad = measure_then_zero
        trainer.train_step()
        opt = trainer.optimizer.optim if hasattr(trainer.optimizer, "optim") else trainer.optimizer
        states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        single = sum(p.numel() * p.element_size() for p in Llama(cfg.model).parameters())
        est = estimate_memory(cfg, world, rank)
        out[name] = {
            "strategy": type(trainer.dp).__name__,
            "report": trainer.dp.memory_report(trainer.model, trainer.optimizer),
            "param_storage": _storage_bytes(params),
            "optim_states": sum(_local(v).numel() * _local(v).element_size() for v in states),
            "single": single,
            # one dim-0 row of every parameter: the most FSDP2 padding can add to one rank's shard
            "row_slack": sum(p.numel() // p.shape[0] * p.element_size() for p in Llama(cfg.model).parameters()),
            "predicted": {"params": est.params, "grads": est.grads, "optimizer": est.optimizer,
                          "param_padding": est.param_padding},
            **seen,
        }
    return out


WORLDS = [2, 4]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """world size -> per-rank results, one spawn per world size, run on first use."""
    cache: dict[int, list] = {}

    def get(world: int) -> list:
        if world not in cache:
            cache[world] = run_ranks(_rank_main, world, (str(tmp_path_factory.mktemp(f"mem{world}")),))
        return cache[world]

    return get


@pytest.mark.parametrize("world", WORLDS)
def test_strategy_is_the_one_the_prediction_models(results, world, tmp_path):
    from fourfold.layout import data_parallel_strategy

    classes = {"ddp": "DDP", "zero1": "Zero1", "fsdp": "FSDP"}
    for name in STRATEGIES:
        predicted = classes[data_parallel_strategy(_config(tmp_path, world, name).parallel)]
        assert [r[name]["strategy"] for r in results(world)] == [predicted] * world, name


@pytest.mark.parametrize("world", WORLDS)
def test_sharded_components_are_one_nth(results, world):
    for rank, rank_result in enumerate(results(world)):
        for name, r in rank_result.items():
            rep, single, slack = r["report"], r["single"], r["row_slack"]
            if name == "dp":
                assert rep == {"param_bytes": single, "grad_bytes": single, "optim_bytes": 2 * single}
            elif name == "zero1":
                # DDP keeps every parameter and gradient; ZeRO-1 gives whole parameters to ranks, so each
                # rank's optimizer share is 1/N within the largest parameter
                assert rep["param_bytes"] == single and rep["grad_bytes"] == single
                largest = 2 * 322 * 64 * 4
                assert abs(rep["optim_bytes"] - 2 * single / world) <= largest
            else:
                for key, full in (("param_bytes", single), ("grad_bytes", single), ("optim_bytes", 2 * single)):
                    per_row = slack if key != "optim_bytes" else 2 * slack
                    assert abs(rep[key] - full / world) <= per_row, (name, rank, key)
    # the optimizer shards of all ranks add up to the whole state
    for name in ("zero1", "zero2", "fsdp"):
        total = sum(rr[name]["report"]["optim_bytes"] for rr in results(world))
        assert total == 2 * results(world)[0][name]["single"], name


@pytest.mark.parametrize("world", WORLDS)
def test_prediction_matches_every_rank_exactly(results, world):
    for rank, rank_result in enumerate(results(world)):
        for name, r in rank_result.items():
            pred, rep = r["predicted"], r["report"]
            # what memory_report counts: the unpadded local shard
            assert rep["param_bytes"] == pred["params"] - pred["param_padding"], (name, rank)
            assert rep["grad_bytes"] == pred["grads"] - pred["param_padding"], (name, rank)
            assert rep["optim_bytes"] == pred["optimizer"] == r["optim_states"], (name, rank)
            # what the allocator holds: padded storages, exactly the prediction
            assert r["param_storage"] == pred["params"], (name, rank)
            assert r["grad_storage"] == pred["grads"], (name, rank)
            assert r["grad_bytes"] == rep["grad_bytes"], (name, rank)


@pytest.mark.parametrize("world", WORLDS)
def test_padding_appears_only_where_fsdp2_shards_unevenly(results, world):
    for rank, rank_result in enumerate(results(world)):
        for name, r in rank_result.items():
            padded = name in ("zero2", "fsdp") and world == 4 and rank == world - 1
            assert (r["predicted"]["param_padding"] > 0) == padded, (rank, name)
