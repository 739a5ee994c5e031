"""fp16 dynamic loss scaling: the scaler's own rules, and overflow-step skipping through the real Trainer.

An inf is planted in one element of the output head's weight gradient at a chosen optimizer step (a tensor
hook on the parameter the forward uses, so it also works on FSDP2's gathered parameter). That step must be
skipped (parameters and AdamW step count unchanged, `skipped_steps` in metrics.jsonl up by one), the loss
scale must halve, and the following steps must train normally. Under fsdp=2 the inf is planted on rank 1
only, in a row that the reduce-scatter hands to rank 0: only rank 0 then sees a non-finite shard, and both
ranks must still skip, which holds only if the overflow flag is all-reduced.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from fourfold.precision import DynamicLossScaler
from fourfold.train.metrics import read_metrics
from tests.distributed.launcher import run_ranks
from tests.trainer_helpers import tiny_config

STEPS = 5
BAD_STEP = 2  # 0-based optimizer step whose gradient gets the inf (reported as step 3 in metrics.jsonl)
INIT_SCALE = 2.0 ** 16


# ----- the scaler on its own ----------------------------------------------------------------------

def test_scale_grows_after_growth_interval_and_backs_off_on_overflow():
    s = DynamicLossScaler(init_scale=8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    for _ in range(2):
        s.update(found_inf=False)
    assert s.scale == 8.0 and s.clean_steps == 2
    s.update(found_inf=False)
    assert s.scale == 16.0 and s.clean_steps == 0
    s.update(found_inf=False)
    s.update(found_inf=True)  # an overflow halves the scale and restarts the clean-step count
    assert s.scale == 8.0 and s.clean_steps == 0 and s.skipped_steps == 1
    for _ in range(2):
        s.update(found_inf=False)
    assert s.scale == 8.0  # the interval counts from the overflow, not from the last growth
    s.update(found_inf=False)
    assert s.scale == 16.0 and s.skipped_steps == 1

    restored = DynamicLossScaler()
    restored.load_state_dict(s.state_dict())
    assert restored.state_dict() == {"scale": 16.0, "clean_steps": 0, "skipped_steps": 1}


def test_unscale_divides_gradients_and_flags_inf_and_nan():
    s = DynamicLossScaler(init_scale=4.0)
    a, b, c = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    a.grad, b.grad = torch.tensor([4.0, 8.0, -12.0]), torch.tensor([2.0, 0.0, 6.0])
    assert s.unscale_and_check([a, b, c]) is False  # c has no gradient and is ignored
    assert torch.equal(a.grad, torch.tensor([1.0, 2.0, -3.0])) and torch.equal(b.grad, torch.tensor([0.5, 0.0, 1.5]))
    for bad in (math.inf, -math.inf, math.nan):
        b.grad = torch.tensor([1.0, bad, 1.0])
        assert s.unscale_and_check([a, b]) is True


def test_loss_is_multiplied_by_the_scale():
    s = DynamicLossScaler(init_scale=1024.0)
    assert s.scale_loss(torch.tensor(0.5)).item() == 512.0


# ----- through the trainer ------------------------------------------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _instrument(trainer, inject: bool, row: int) -> dict:
    """Plant an inf at output.weight.grad[row, 0] on step BAD_STEP (if `inject`); record per-step facts."""
    log = {"changed": [], "skipped": [], "local_inf": [], "scale_after": []}
    head = trainer.model.output
    handles = []

    def plant(grad):
        grad = grad.clone()
        grad[row, 0] = math.inf
        return grad

    def arm(module, args):
        # Runs before every micro-batch's head forward; only the first of step BAD_STEP plants the inf.
        if inject and trainer.step == BAD_STEP and not handles:
            handles.append(module.weight.register_hook(plant))

    head.register_forward_pre_hook(arm)

    scaler = trainer.scaler
    original_check = scaler.unscale_and_check

    def check(params):
        # What this rank's own (sharded) gradients say, before the flag is combined across ranks.
        grads = [_local(p.grad) for p in params if p.grad is not None]
        log["local_inf"].append(any(not torch.isfinite(g).all() for g in grads))
        return original_check(params)

    scaler.unscale_and_check = check
    original_step = trainer.train_step

    def step():
        before = [_local(p.detach()).clone() for p in trainer.model.parameters()]
        out = original_step()
        after = [_local(p.detach()) for p in trainer.model.parameters()]
        log["changed"].append(any(not torch.equal(x, y) for x, y in zip(before, after)))
        log["skipped"].append(bool(out[2]))
        log["scale_after"].append(scaler.scale)
        for h in handles:
            h.remove()
        return out

    trainer.train_step = step
    return log


def _adamw_steps(trainer) -> set[float]:
    return {float(s["step"]) for s in trainer.optimizer.state.values()}


def _assert_only_bad_step_skipped(log: dict) -> None:
    expected_skips = [i == BAD_STEP for i in range(STEPS)]
    assert log["skipped"] == expected_skips
    assert log["changed"] == [not s for s in expected_skips]  # parameters frozen exactly across the bad step
    scales = [INIT_SCALE if i < BAD_STEP else INIT_SCALE / 2 for i in range(STEPS)]
    assert log["scale_after"] == scales


def _assert_metrics(run_dir: Path) -> None:
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["skipped_steps"] for r in records] == [0 if i < BAD_STEP else 1 for i in range(STEPS)]
    assert [r["loss_scale"] for r in records] == [INIT_SCALE if i < BAD_STEP else INIT_SCALE / 2
                                                  for i in range(STEPS)]
    assert all(math.isfinite(r["loss"]) for r in records)
    # The steps after the skipped one train: the loss keeps falling from where it was.
    assert records[-1]["loss"] < records[BAD_STEP]["loss"]


def _fp16_config(tmp: Path, **extra):
    return tiny_config(tmp, **{"compute.precision": "fp16", "train.steps": STEPS, "optim.lr": "1e-2",
                               "checkpoint.save_final": "false", **extra})


def test_fp16_trainer_skips_exactly_the_overflow_step(tmp_path):
    from fourfold.train.trainer import Trainer

    trainer = Trainer(_fp16_config(tmp_path), tmp_path / "run")
    assert trainer.scaler is not None and trainer.scaler.scale == INIT_SCALE
    log = _instrument(trainer, inject=True, row=0)
    trainer.run()
    _assert_only_bad_step_skipped(log)
    assert log["local_inf"] == log["skipped"]
    assert _adamw_steps(trainer) == {float(STEPS - 1)}  # the optimizer stepped once per clean step
    assert trainer.scaler.skipped_steps == 1
    _assert_metrics(tmp_path / "run")


def _fsdp_rank(rank: int, world: int, tmp: str) -> dict:
    from fourfold.train.trainer import Trainer

    trainer = Trainer(_fp16_config(Path(tmp), **{"parallel.fsdp": 2}), Path(tmp) / "fsdp2")
    vocab = trainer.cfg.model.vocab_size
    # FSDP2 shards output.weight by rows: rows [0, vocab/2) end up on rank 0. Plant on rank 1, row 0.
    log = _instrument(trainer, inject=(rank == 1), row=0)
    trainer.run()
    log["adamw_steps"] = _adamw_steps(trainer)
    log["head_shard_rows"] = _local(trainer.model.output.weight).shape[0]
    log["vocab"] = vocab
    return log


def test_overflow_on_one_fsdp_rank_skips_the_step_on_both(tmp_path):
    logs = run_ranks(_fsdp_rank, 2, args=(str(tmp_path),))
    assert logs[0]["head_shard_rows"] == logs[0]["vocab"] // 2
    # Only rank 0's shard holds the inf (planted on rank 1, moved by the reduce-scatter) ...
    assert logs[0]["local_inf"] == [i == BAD_STEP for i in range(STEPS)]
    assert logs[1]["local_inf"] == [False] * STEPS
    # ... yet both ranks skip that step and only that step, and keep the same loss scale.
    for log in logs:
        _assert_only_bad_step_skipped(log)
        assert log["adamw_steps"] == {float(STEPS - 1)}
    _assert_metrics(tmp_path / "fsdp2")
