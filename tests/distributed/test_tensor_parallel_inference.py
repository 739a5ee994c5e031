"""The one forward serves tensor-parallel inference: a KV-cached ragged batch on tp=2 gloo ranks equals one process.

Each rank's attention hands the cache only its own heads (the cache sizes itself from them); the head's
logits come back vocab-sharded and are gathered here for the comparison. float64, rtol 1e-10.
"""

from __future__ import annotations

import torch

from fourfold.config import ModelConfig
from fourfold.infer.kv_cache import KVCache
from fourfold.models.llama import Llama
from tests.distributed.launcher import run_ranks

MODEL = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=32)
PROMPT_LENGTHS = (3, 6)
DECODE_STEPS = 3


def _model() -> Llama:
    torch.manual_seed(3)
    return Llama(ModelConfig(**MODEL)).double().eval()


@torch.no_grad()
def _cached_run(model: Llama) -> tuple[list[torch.Tensor], KVCache]:
    """Logits (batch, vocab) of each sequence's newest token: a right-padded prefill, then decode steps."""
    gen = torch.Generator().manual_seed(0)
    batch, longest = len(PROMPT_LENGTHS), max(PROMPT_LENGTHS)
    tokens = torch.randint(0, MODEL["vocab_size"], (batch, longest + DECODE_STEPS), generator=gen)
    lengths = torch.tensor(PROMPT_LENGTHS)
    rows = torch.arange(batch)
    cache = KVCache(MODEL["n_layers"], batch, longest + DECODE_STEPS)
    positions = torch.arange(longest).expand(batch, -1)
    step_logits = [model(tokens[:, :longest], positions, cache=cache.step(positions),
                         logits_for=rows * longest + lengths - 1)]
    for step in range(DECODE_STEPS):
        positions = (lengths + step)[:, None]
        fed = tokens[rows, longest + step][:, None]
        step_logits.append(model(fed, positions, cache=cache.step(positions), logits_for=rows))
    return step_logits, cache


def _tp_rank(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from fourfold.parallel.tensor import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (world_size,))
    model = apply_tensor_parallel(_model(), mesh, sequence_parallel=False)
    step_logits, cache = _cached_run(model)
    return {"logits": [logits.full_tensor() for logits in step_logits],
            "cached_kv_heads": cache.keys[0].shape[1]}


def test_tensor_parallel_cached_forward_equals_one_process():
    expected, _ = _cached_run(_model())
    for result in run_ranks(_tp_rank, world_size=2):
        assert result["cached_kv_heads"] == MODEL["n_kv_heads"] // 2
        for got, want in zip(result["logits"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
