"""Parallel inference: the engine on tp=2 gloo ranks (each loading only its shards of a checkpoint and caching
only its own kv heads) and on pp=2 stages (each holding and caching only its blocks) generates the same greedy
tokens as one process (float64)."""

from __future__ import annotations

import pytest
import torch

from fourfold.infer.engine import LLMEngine
from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.llm import LLM
from fourfold.infer.loading import load_model
from fourfold.infer.requests import SamplingParams
from fourfold.testing.runs import tiny_config
from fourfold.train.trainer import train
from tests.distributed.launcher import run_ranks

PROMPTS = ["def f(x):", "ab", "class Stack:\n    def push"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ENGINE = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=8)  # chunked prefill across the batch


def _generate(engine: LLMEngine) -> dict:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    tokens = {str(i): [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
    return tokens


def _tp_rank(rank: int, world_size: int, run_dir: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    cpu = torch.device("cpu")
    loaded = load_model(run_dir, cpu, torch.float64, tp_mesh=mesh)
    engine = LLMEngine.from_model(loaded.model, loaded.tokenizer, EngineConfig(**ENGINE), cpu, loaded.kv_heads,
                                  group=dist.group.WORLD, sampling_seed=0)
    wq = loaded.model.layers["0"].attention.wq.weight
    return {"tokens": _generate(engine), "kv_heads": engine.runner.pool.keys.shape[3],
            "local_rows": wq.to_local().shape[0], "rows": wq.shape[0]}


def _pp_rank(rank: int, world_size: int, run_dir: str) -> dict:
    import torch.distributed as dist

    cpu = torch.device("cpu")
    loaded = load_model(run_dir, cpu, torch.float64, pp=(rank, world_size))
    engine = LLMEngine.from_model(loaded.model, loaded.tokenizer, EngineConfig(**ENGINE), cpu, loaded.kv_heads,
                                  group=dist.group.WORLD, pipeline_ranks=list(range(world_size)), sampling_seed=0)
    return {"tokens": _generate(engine), "layers": list(loaded.layers),
            "pool_layers": engine.runner.pool.keys.shape[0]}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    # Large random weights and a tiny learning rate: greedy tokens that depend on every context token.
    train(tiny_config(tmp, **{"train.steps": "1", "checkpoint.save_final": "true", "model.init_std": "0.4",
                              "optim.lr": "1e-6"}), tmp / "run")
    return tmp / "run"


@pytest.mark.slow
def test_tp2_engine_generates_what_one_process_generates(run_dir):
    one = LLM(run_dir, dtype=torch.float64, **ENGINE)
    want = _generate(one.engine)
    for result in run_ranks(_tp_rank, world_size=2, args=(str(run_dir),)):
        assert result["tokens"] == want
        assert result["kv_heads"] == 1 and result["local_rows"] * 2 == result["rows"]


@pytest.mark.slow
def test_pp2_engine_generates_what_one_process_generates(run_dir):
    one = LLM(run_dir, dtype=torch.float64, **ENGINE)
    want = _generate(one.engine)
    results = run_ranks(_pp_rank, world_size=2, args=(str(run_dir),))
    for result in results:
        assert result["tokens"] == want
        assert result["pool_layers"] == len(result["layers"]) == 2
    assert results[0]["layers"] == [0, 1] and results[1]["layers"] == [2, 3]
