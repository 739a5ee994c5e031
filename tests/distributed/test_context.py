"""Context parallelism on gloo (float64): ring and all-gather attention, and the tiny Llama, against one process.

Pure tests check the load-balanced layout (sharding, positions, the ring's block plan against the
dense causal mask). Then one spawn per cp size (2 and 4) runs, for each attention core:
- the core alone on a sharded (b, hq=4, s, d) input with GQA (hkv=2): output and q/k/v gradients must
  equal full causal SDPA on the whole sequence (tolerance 1e-10);
- the tiny Llama with `apply_context_parallel`: logits (gathered with `unshard_sequence`) and every
  parameter gradient (averaged over cp, as data-parallel reduction will) must equal the single-process
  model's, and 5 AdamW steps must give the same losses (the mean of the ranks' local means) and final
  parameters.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fourfold.config import ModelConfig
from fourfold.errors import ConfigError, LayoutError
from fourfold.parallel.context import (apply_context_parallel, chunk_ids, positions_for, shard_batch,
                                       shard_sequence, to_global_order)
from fourfold.parallel.ring_attention import hop_blocks
from tests.distributed.launcher import run_ranks

METHODS = ("ring", "allgather")
ATTN_SHAPE = dict(batch=2, hq=4, hkv=2, seq=32, head_dim=8)
MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=32)
BATCH, SEQ, STEPS, LR = 2, 16, 5, 3e-3


# ---- the layout, no processes -------------------------------------------------------------------------

@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shards_cover_the_sequence_and_balance_causal_work(cp):
    seq = 4 * cp
    positions = [positions_for(seq, r, cp) for r in range(cp)]
    assert sorted(torch.cat(positions).tolist()) == list(range(seq))
    # Causal work of a rank = number of (query, key <= query) pairs = sum over its positions of (p + 1).
    work = {int((p + 1).sum()) for p in positions}
    assert len(work) == 1
    x = torch.arange(2 * seq).view(2, seq)
    inputs, targets, pos = shard_batch(x, x + 100, cp - 1, cp)
    assert torch.equal(inputs, x[:, positions[cp - 1]]) and torch.equal(targets, x[:, positions[cp - 1]] + 100)
    assert torch.equal(pos, positions[cp - 1])
    gathered = torch.cat([shard_sequence(x, 1, r, cp) for r in range(cp)], dim=1)
    assert torch.equal(to_global_order(gathered, 1, cp), x)


def test_indivisible_sequence_is_a_layout_error():
    with pytest.raises(LayoutError, match="multiple of 8"):
        shard_sequence(torch.zeros(1, 12), 1, 0, 4)


def test_unknown_method_is_a_config_error():
    from fourfold.models.llama import Llama

    with pytest.raises(ConfigError, match="ring or allgather"):
        apply_context_parallel(Llama(MODEL), None, method="zigzag")


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_block_plan_is_the_causal_mask(cp):
    local = 6
    seq = local * cp
    for rank in range(cp):
        q_pos = positions_for(seq, rank, cp)
        for owner in range(cp):
            k_pos = positions_for(seq, owner, cp)
            rows, cols, causal = hop_blocks(rank, owner, cp, local)
            planned = torch.zeros(local, local, dtype=torch.bool)
            block = planned[rows, cols]
            planned[rows, cols] = torch.ones_like(block).tril() if causal else True
            assert causal == (block.shape[0] == block.shape[1] and owner == rank)
            assert torch.equal(planned, q_pos[:, None] >= k_pos[None, :]), (rank, owner, chunk_ids(owner, cp))


# ---- cp ranks against one process -----------------------------------------------------------------------

def _attention_inputs():
    s = ATTN_SHAPE
    gen = torch.Generator().manual_seed(3)

    def randn(heads):
        return torch.randn(s["batch"], heads, s["seq"], s["head_dim"], generator=gen, dtype=torch.float64)

    return randn(s["hq"]), randn(s["hkv"]), randn(s["hkv"]), randn(s["hq"])  # q, k, v, upstream grad


def _batches():
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, MODEL.vocab_size, (STEPS, BATCH, SEQ + 1), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _model():
    from fourfold.models.llama import Llama

    torch.manual_seed(0)
    return Llama(MODEL).to(torch.float64)


def _train(model, batch_fn) -> dict:
    """5 AdamW steps; batch_fn(inputs, targets) -> (loss, logits) with grads accumulated in `model`."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=False)
    record: dict = {"losses": []}
    for step, (inputs, targets) in enumerate(_batches()):
        optimizer.zero_grad()
        loss, logits = batch_fn(inputs, targets)
        if step == 0:
            record["logits"] = logits
            record["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        record["losses"].append(float(loss))
        optimizer.step()
    record["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return record


def _cp_rank(rank: int, cp: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fourfold.parallel.context import CORES, unshard_sequence

    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    group = mesh.get_group()
    results = {}
    for method in METHODS:
        q, k, v, upstream = (shard_sequence(t, 2, rank, cp) for t in _attention_inputs())
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = CORES[method](mesh)(q, k, v)
        (out * upstream).sum().backward()
        results[("attention", method)] = [t.detach() for t in (out, q.grad, k.grad, v.grad)]

        model = apply_context_parallel(_model(), mesh, method)

        def cp_step(inputs, targets):
            inputs, targets, positions = shard_batch(inputs, targets, rank, cp)
            logits = model(inputs, positions)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            for p in model.parameters():  # what the data-parallel reduction over cp will do
                dist.all_reduce(p.grad, group=group)
                p.grad /= cp
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=group)
            return mean / cp, unshard_sequence(logits.detach(), 1, group)

        results[("model", method)] = _train(model, cp_step)
    return _by_value(results)


def _by_value(obj):
    """Tensors as numpy arrays, so results pickle by value (torch's queue would pass shared-memory handles
    that die with the child process)."""
    if isinstance(obj, torch.Tensor):
        return obj.numpy()
    if isinstance(obj, dict):
        return {k: _by_value(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_by_value(v) for v in obj)
    return obj


def _as_tensors(obj):
    if hasattr(obj, "__array__") and not isinstance(obj, torch.Tensor):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _as_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_as_tensors(v) for v in obj)
    return obj


def _single_step(model):
    def step(inputs, targets):
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        return loss.detach(), logits.detach()
    return step


@pytest.fixture(scope="module", params=[2, 4], ids=lambda cp: f"cp{cp}")
def cp_results(request):
    cp = request.param
    return cp, _as_tensors(run_ranks(_cp_rank, cp, args=()))


@pytest.fixture(scope="module")
def reference():
    q, k, v, upstream = _attention_inputs()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (out * upstream).sum().backward()
    attention = [t.detach() for t in (out, q.grad, k.grad, v.grad)]
    model = _model()
    return attention, _train(model, _single_step(model))


@pytest.mark.parametrize("method", METHODS)
def test_attention_core_matches_full_causal_attention(cp_results, reference, method):
    cp, ranks = cp_results
    for rank, result in enumerate(ranks):
        for name, got, full in zip(("output", "dq", "dk", "dv"), result[("attention", method)], reference[0]):
            torch.testing.assert_close(got, shard_sequence(full, 2, rank, cp), rtol=1e-10, atol=1e-10,
                                       msg=lambda m: f"cp={cp} rank {rank} {name}: {m}")


@pytest.mark.parametrize("method", METHODS)
def test_llama_logits_and_gradients_match_single_process(cp_results, reference, method):
    cp, ranks = cp_results
    ref = reference[1]
    for rank, result in enumerate(ranks):
        got = result[("model", method)]
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-10, atol=1e-12)
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-9, atol=1e-13,
                                       msg=lambda m: f"cp={cp} rank {rank} grad {name}: {m}")


@pytest.mark.parametrize("method", METHODS)
def test_llama_adamw_steps_match_single_process(cp_results, reference, method):
    cp, ranks = cp_results
    ref = reference[1]
    for rank, result in enumerate(ranks):
        got = result[("model", method)]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-12, atol=0)
        for name, param in ref["params"].items():
            torch.testing.assert_close(got["params"][name], param, rtol=1e-9, atol=1e-12,
                                       msg=lambda m: f"cp={cp} rank {rank} param {name}: {m}")
