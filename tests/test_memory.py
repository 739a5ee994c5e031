"""The memory prediction against what a single-process Trainer really holds, and its layout arithmetic.

Parameters, gradients and AdamW state are predicted exactly. Activations are predicted exactly too on
CPU (tolerance 0): the per-block formula in fourfold/plan/memory.py is derived from the tensors the
model's ops keep for backward, and `saved_activation_bytes` measures the same tensors, for every
recompute mode, in fp32, bf16 autocast and fp64, with the plain and the chunked loss.
"""

from __future__ import annotations

import pytest
import torch
from rich.console import Console

from fourfold.config import build_config
from fourfold.errors import LayoutError
from fourfold.plan.layout import fsdp_rows
from fourfold.plan.memory import COMPONENTS, LABELS, MemoryEstimate, estimate_memory, measure_saved_activations
from fourfold.recompute import saved_activation_bytes
from fourfold.train.trainer import Trainer
from tests.trainer_helpers import tiny_config

SMALL = {"model.dim": 64, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_dim": 128,
         "model.max_seq_len": 32, "train.seq_len": 32, "train.micro_batch": 2, "train.global_batch": 2}
MODES = ("none", "every-2", "selective", "full")


def _trainer(tmp_path, name: str, **overrides) -> Trainer:
    cfg = tiny_config(tmp_path, **{**SMALL, **overrides})
    return Trainer(cfg, tmp_path / name)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _measured_saved(trainer: Trainer) -> int:
    """What one micro-batch's forward (under the trainer's autocast) and loss leave for backward."""
    inputs, targets = trainer.train_batches.next_step()[0]
    model, ctx = trainer.model, trainer.runner

    def forward_and_loss():
        with ctx.autocast():
            logits = model(inputs)
        return ctx.loss_fn(logits, targets)

    state = tuple(model.parameters()) + tuple(model.buffers())
    _, saved = saved_activation_bytes(forward_and_loss, exclude=state)
    return saved


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp64"])
def test_parameters_gradients_and_optimizer_state_are_exact(tmp_path, precision):
    trainer = _trainer(tmp_path, precision, **{"compute.precision": precision})
    seen = {}
    zero_grad = trainer.optimizer.zero_grad

    def measure_then_zero(*args, **kwargs):  # gradients exist between backward and zero_grad
        seen["grads"] = _nbytes(p.grad for p in trainer.model.parameters() if p.grad is not None)
        return zero_grad(*args, **kwargs)

    trainer.optimizer.zero_grad = measure_then_zero
    trainer.train_step()
    states = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    moments = [v for v in states if v.dim() > 0]
    est = estimate_memory(trainer.cfg, 1)

    assert est.params == _nbytes(trainer.model.parameters())
    assert est.grads == seen["grads"] > 0
    assert est.optimizer == _nbytes(moments)
    # what the prediction leaves out: AdamW's 0-d step counter, one per parameter (as memory_report does)
    assert len(states) - len(moments) == len(list(trainer.model.parameters()))
    assert trainer.dp.memory_report(trainer.model, trainer.optimizer) == {
        "param_bytes": est.params, "grad_bytes": est.grads, "optim_bytes": est.optimizer}
    master = 8 if precision == "fp64" else 4
    assert est.optimizer == 2 * est.params and est.params % master == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activations_match_saved_bytes_for_every_recompute_mode(tmp_path, precision):
    measured, predicted = {}, {}
    for mode in MODES:
        trainer = _trainer(tmp_path, f"{precision}-{mode}", **{"compute.precision": precision, "compute.recompute": mode})
        measured[mode] = _measured_saved(trainer)
        est = estimate_memory(trainer.cfg, 1)
        predicted[mode] = est.saved_for_backward
        assert est.saved_for_backward == est.activations + est.logits_saved
    # Tolerance 0: the formula accounts for every tensor autograd keeps (see the table in plan/memory.py).
    assert predicted == measured
    # The order of saved bytes depends on the precision (the derivation is in the module docstring):
    # selective keeps every matmul output, more than half of a plain block in fp32, less under autocast.
    if precision == "fp32":
        order = ("none", "selective", "every-2", "full")
    else:
        order = ("none", "every-2", "selective", "full")
    for saved in (measured, predicted):
        assert [saved[m] for m in order] == sorted(saved.values(), reverse=True)
        assert len(set(saved.values())) == len(MODES)


@pytest.mark.parametrize("overrides", [
    {"compute.loss_chunk": 16},
    {"compute.precision": "bf16", "compute.loss_chunk": 24, "compute.recompute": "every-3"},
    {"compute.precision": "fp64", "compute.recompute": "selective"},
    {"model.tie_embeddings": True, "model.dim": 96, "model.n_heads": 6, "model.ffn_dim": 200, "train.seq_len": 27,
     "train.micro_batch": 3, "model.vocab_size": 101},
])
def test_prediction_is_exact_for_other_shapes_precisions_and_losses(overrides):
    cfg = build_config({}, {**SMALL, "model.vocab_size": 96, "compute.device": "cpu", "train.global_batch": 3,
                            "train.micro_batch": 3, **overrides})
    assert estimate_memory(cfg, 1).saved_for_backward == measure_saved_activations(cfg)


def test_chunked_loss_keeps_one_logits_sized_gradient_instead_of_fp32_log_probs():
    base = {**SMALL, "model.vocab_size": 4096, "compute.device": "cpu", "compute.precision": "bf16"}
    plain = estimate_memory(build_config({}, base), 1)
    chunked = estimate_memory(build_config({}, {**base, "compute.loss_chunk": 16}), 1)
    tokens = 2 * 32
    assert plain.logits_saved == tokens * 4096 * 4 + tokens * 8 + 2 * 4  # fp32 log-probs, targets, 2 scalars
    assert chunked.logits_saved == tokens * 4096 * 2 + 4  # the bf16 gradient and the loss
    assert chunked.logits < plain.logits
    assert chunked.activations == plain.activations


def test_table_lists_every_component_and_the_measured_column(tmp_path):
    trainer = _trainer(tmp_path, "table")
    trainer.train_step()
    est = estimate_memory(trainer.cfg, 1)
    console = Console(record=True, width=200)
    console.print(est.table())
    text = console.export_text()
    for name in COMPONENTS + ("total",):
        assert LABELS[name] in text, name
    assert "measured" not in text and "rank 0 of 1" in text
    report = trainer.dp.memory_report(trainer.model, trainer.optimizer)
    compared = est.compare(report)
    assert compared.measured == {"params": est.params, "grads": est.grads, "optimizer": est.optimizer}
    console = Console(record=True, width=200)
    console.print(compared.table())
    text = console.export_text()
    assert "measured" in text and "+0.0%" in text
    with pytest.raises(KeyError, match="unknown measured component"):
        est.compare({"bogus_bytes": 1})


def test_total_is_the_larger_of_the_backward_peak_and_the_optimizer_step():
    est = MemoryEstimate(params=10, grads=10, optimizer=20, activations=5, logits=3, workspace=2, step_workspace=4)
    assert est.total == 40 + 10
    assert MemoryEstimate(1, 1, 2, 0, 0, 0, step_workspace=7).total == 4 + 7


def _cfg(**overrides):
    flat = {**SMALL, "model.vocab_size": 96, "compute.device": "cpu", "train.global_batch": 8, **overrides}
    return build_config({}, {k: str(v) for k, v in flat.items()})


def _count(cfg) -> dict[str, int]:
    """Elements per parameter of the unsplit model."""
    from fourfold.models.llama import Llama

    return {n: p.numel() for n, p in Llama(cfg.model).named_parameters()}


def test_tensor_parallel_splits_every_matrix_and_replicates_norms():
    counts = _count(_cfg())
    norms = sum(v for n, v in counts.items() if n.endswith("norm.weight"))
    matrices = sum(counts.values()) - norms
    est = estimate_memory(_cfg(**{"parallel.tp": 2}), 2)
    assert est.params == (matrices // 2 + norms) * 4
    sp = estimate_memory(_cfg(**{"parallel.tp": 2}), 2)
    no_sp = estimate_memory(_cfg(**{"parallel.tp": 2, "parallel.sequence_parallel": False}), 2)
    assert sp.activations < no_sp.activations  # norms and residuals hold seq / tp positions


def test_pipeline_stages_hold_their_own_blocks_and_the_worst_rank_is_reported():
    cfg = _cfg(**{"parallel.pp": 2, "model.vocab_size": 1024, "train.micro_batch": 1})
    counts = _count(cfg)
    stage0 = sum(v for n, v in counts.items() if n.startswith(("tok_embeddings", "layers.0.", "layers.1.")))
    first, last = estimate_memory(cfg, 2, rank=0), estimate_memory(cfg, 2, rank=1)
    assert first.params == stage0 * 4 and last.params == (sum(counts.values()) - stage0) * 4
    assert first.logits == 0 < last.logits  # the loss lives on the last stage
    worst = estimate_memory(cfg, 2)
    assert worst.total == max(first.total, last.total) and "holds the most" in worst.notes[0]
    # 1F1B: the first stage holds pp micro-batches in flight, the last one; GPipe holds all of them
    assert (first.microbatches_in_flight, last.microbatches_in_flight) == (2, 1)
    gpipe = _cfg(**{"parallel.pp": 2, "parallel.pp_schedule": "gpipe", "train.micro_batch": 1})
    assert estimate_memory(gpipe, 2, rank=0).microbatches_in_flight == 8


def test_fsdp_pads_each_shard_to_ceil_rows_and_hsdp_shards_over_fsdp_only():
    assert fsdp_rows(10, 4, 0) == (3, 3) and fsdp_rows(10, 4, 3) == (3, 1) and fsdp_rows(2, 4, 3) == (1, 0)
    counts = _count(_cfg())
    total = sum(counts.values())
    fsdp4 = estimate_memory(_cfg(**{"parallel.fsdp": 4}), 4)
    assert fsdp4.params == total  # every dim 0 here divides by 4: no padding, 1/4 of the fp32 bytes
    hsdp = estimate_memory(_cfg(**{"parallel.dp": 2, "parallel.fsdp": 2}), 4)
    assert hsdp.params == total * 2 and hsdp.optimizer == total * 4
    cp = estimate_memory(_cfg(**{"parallel.cp": 2}), 2)  # context-parallel ranks shard like fsdp ranks
    assert cp.params == total * 2
    padded = estimate_memory(_cfg(**{"parallel.fsdp": 4, "model.vocab_size": 98}), 4, rank=3)
    assert padded.param_padding == 2 * 2 * 64 * 4  # embedding and head: 25 rows stored, 23 local
    assert padded.optimizer == 2 * (padded.params - padded.param_padding)


def test_zero1_shards_only_the_optimizer_and_offload_moves_state_to_the_host():
    total = sum(_count(_cfg()).values())
    zero1 = estimate_memory(_cfg(**{"parallel.fsdp": 2, "parallel.zero": 1}), 2)
    assert zero1.params == zero1.grads == total * 4
    shares = [estimate_memory(_cfg(**{"parallel.fsdp": 2, "parallel.zero": 1}), 2, rank=r).optimizer for r in (0, 1)]
    assert sum(shares) == total * 8 and zero1.optimizer == max(shares)
    offload = estimate_memory(_cfg(**{"parallel.fsdp": 2, "parallel.cpu_offload": True}), 2)
    assert offload.params == offload.grads == offload.optimizer == 0 and offload.host == total * 4 // 2 * 4


@pytest.mark.parametrize("ranks, overrides", [
    (2, {"parallel.dp": 2}), (4, {"parallel.dp": 2, "parallel.fsdp": 2}), (2, {"parallel.tp": 2}),
    (4, {"parallel.tp": 2, "parallel.fsdp": 2}), (2, {"parallel.cp": 2}),
    (2, {"parallel.cp": 2, "parallel.cp_method": "allgather"}), (4, {"parallel.cp": 2, "parallel.tp": 2}),
    (2, {"parallel.pp": 2, "parallel.vpp": 2, "parallel.pp_schedule": "interleaved-1f1b"}),
    (2, {"parallel.pp": 2, "parallel.pp_schedule": "zero-bubble"}),
    (8, {"parallel.pp": 2, "parallel.fsdp": 2, "parallel.tp": 2, "parallel.param_dtype": "bf16",
         "compute.precision": "bf16", "compute.recompute": "selective"}),
    (1, {"compute.device": "cuda", "compute.precision": "bf16"}), (1, {"compute.device": "cuda"}),
    (1, {"compute.device": "cuda", "compute.precision": "fp64"}),
])
def test_every_layout_has_a_prediction_for_every_rank(ranks, overrides):
    cfg = _cfg(**overrides)
    worst = estimate_memory(cfg, ranks)
    per_rank = [estimate_memory(cfg, ranks, rank=r) for r in range(ranks)]
    assert max(e.total for e in per_rank) == worst.total
    for e in per_rank:
        assert min(getattr(e, c) for c in COMPONENTS) >= 0 and e.total > 0


def test_a_layout_that_does_not_fit_the_world_is_refused():
    with pytest.raises(LayoutError, match="uses 2 ranks but 4"):
        estimate_memory(_cfg(**{"parallel.tp": 2}), 4)


def test_compiled_loss_keeps_the_logits_and_one_log_sum_exp_per_token():
    base = {**SMALL, "model.vocab_size": 4096, "compute.device": "cpu", "compute.precision": "bf16"}
    plain = estimate_memory(build_config({}, base), 1)
    compiled = estimate_memory(build_config({}, {**base, "compute.compile": "true"}), 1)
    chunked = estimate_memory(build_config({}, {**base, "compute.compile": "true", "compute.loss_chunk": 16}), 1)
    tokens = 2 * 32
    assert compiled.logits_saved == tokens * 4096 * 2 + tokens * 4 + tokens * 8  # bf16 logits, fp32 lse, targets
    assert compiled.logits == 2 * tokens * 4096 * 2  # the logits and their bf16 gradient at backward start
    assert compiled.logits < plain.logits
    assert chunked.logits_saved == tokens * 4096 * 2 + 4  # loss_chunk still chooses the chunked loss
