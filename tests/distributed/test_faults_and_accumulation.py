"""Gradient accumulation is exact and communicates once per optimizer step; a broken gradient collective is caught.

(a) One process: global batch 8 as 4 micro-batches of 2 trains exactly like one micro-batch of 8. On 2 gloo
    ranks with DDP, a counting comm hook shows every gradient bucket is all-reduced once per optimizer step
    (on the last micro-step), not once per micro-step; a control step with synchronisation forced on every
    micro-step shows the count would have doubled. With FSDP, a dispatch mode counts the reduce-scatters
    between optimizer steps: one per FSDP unit per step, not one per unit per micro-step.
(b) The dp=2 parity check of tests/distributed/test_layouts.py is run with sabotaged gradient reductions
    (summing without dividing by the world size; skipping the all-reduce so ranks drift apart): the
    comparison against the single-process run must fail, so the layout tests would catch a wrong collective.
(c) The launcher those tests stand on fails a call whose rank raises or dies, rather than waiting forever.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode

from fourfold.train.trainer import Trainer, train
from tests.distributed.launcher import run_ranks
from tests.trainer_helpers import assert_matches_reference, grad_norms, losses, run_results, tiny_config, \
    train_on_rank

STEPS = 5
DP2 = {"parallel.dp": 2, "parallel.bucket_mb": 0.05}  # small buckets: several per step, so counts mean something
FSDP2 = {"parallel.fsdp": 2}


def _cfg(tmp: Path, **extra):
    return tiny_config(tmp, **{"compute.precision": "fp64", "train.steps": STEPS, **extra})


class _CountReduceScatters(TorchDispatchMode):
    """Counts process-group reduce-scatters (c10d ops) run while active, however torch.distributed was called."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and "reduce_scatter" in func.__name__:
            self.count += 1
        return func(*args, **(kwargs or {}))


# ----- single-process accumulation ---------------------------------------------------------------

def test_four_micro_steps_equal_one_big_micro_batch(tmp_path):
    train(_cfg(tmp_path, **{"train.micro_batch": 2}), tmp_path / "accum4")
    train(_cfg(tmp_path, **{"train.micro_batch": 8}), tmp_path / "accum1")
    assert_matches_reference(tmp_path / "accum4", run_results(tmp_path / "accum1"), check_grad_norm=True)
    assert losses(tmp_path / "accum4")[-1] < losses(tmp_path / "accum4")[0]  # it trained


# ----- two ranks: communication per step, and sabotaged reductions --------------------------------

def _allreduce_mean(bucket) -> torch.futures.Future:
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def _sum_without_dividing(bucket) -> torch.futures.Future:
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def _no_allreduce(bucket) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())  # each rank keeps its own gradient: the replicas drift apart
    return fut


SABOTAGE = {"sum-not-mean": _sum_without_dividing, "local-only": _no_allreduce}


def _ranks(rank: int, world: int, tmp: str) -> dict:
    tmp = Path(tmp)
    out = {}

    # 1. A correct reduction, counted: (optimizer step, bucket index) of every bucket all-reduce.
    trainer = Trainer(_cfg(tmp, **DP2), tmp / "counted")
    calls: list[tuple[int, int]] = []

    def counting(state, bucket):
        calls.append((trainer.step, bucket.index()))
        return _allreduce_mean(bucket)

    trainer.model.register_comm_hook(None, counting)
    trainer.run()
    logging = trainer.model._get_ddp_logging_data()
    out["calls"] = list(calls)
    out["initial_buckets"] = len(str(logging["bucket_sizes"]).split(","))
    out["rebuilt_buckets"] = len(str(logging["rebuilt_bucket_sizes"]).split(","))
    out["micro_steps"] = len(trainer.train_batches.next_step())
    # Control: one more step with gradient sync forced on for every micro-step must reduce more often.
    trainer.runner.grad_sync = lambda enabled: trainer.dp.grad_sync(trainer.model, True)
    calls.clear()
    trainer.train_step()
    out["forced_calls"] = len(calls)

    # 2. FSDP: reduce-scatters between one optimizer step and the next (the first counts from the start).
    trainer = Trainer(_cfg(tmp, **FSDP2), tmp / "fsdp-counted")
    counter, per_step = _CountReduceScatters(), []
    trainer.optimizer.register_step_pre_hook(lambda *_: per_step.append(counter.count - sum(per_step)))
    with counter:
        trainer.run()
    out["fsdp_reductions_per_step"] = per_step
    out["fsdp_units"] = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
    out["fsdp_micro_steps"] = len(trainer.train_batches.next_step())

    # 3. The same layout with broken reductions (rank 0 writes the run's metrics and checkpoint).
    for name, hook in SABOTAGE.items():
        trainer = Trainer(_cfg(tmp, **DP2), tmp / name)
        trainer.model.register_comm_hook(None, lambda state, bucket, hook=hook: hook(bucket))
        trainer.run()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    train(_cfg(tmp), tmp / "single")
    ref = run_results(tmp / "single")
    results = run_ranks(_ranks, 2, args=(str(tmp),))
    return tmp, ref, results


def test_ddp_reduces_each_bucket_once_per_optimizer_step(runs):
    tmp, ref, results = runs
    for result in results:
        assert result["micro_steps"] == 2  # global 8 = micro 2 x 2 micro-steps x 2 ranks
        per_step: dict[int, list[int]] = {}
        for step, index in result["calls"]:
            per_step.setdefault(step, []).append(index)
        assert sorted(per_step) == list(range(STEPS))
        # DDP starts with one bucket and rebuilds them (in backward order) after the first step.
        assert sorted(per_step[0]) == list(range(result["initial_buckets"]))
        assert result["rebuilt_buckets"] > 1
        for step in range(1, STEPS):
            assert sorted(per_step[step]) == list(range(result["rebuilt_buckets"])), step
        assert result["forced_calls"] == result["micro_steps"] * result["rebuilt_buckets"]
    # The counting hook is a correct reduction: this run passes the parity check, gradient norms included.
    assert_matches_reference(tmp / "counted", ref, check_grad_norm=True)


def test_fsdp_reduce_scatters_each_unit_once_per_optimizer_step(runs):
    """Under FSDP, accumulation micro-steps keep unsharded gradients locally; only the step's last backward
    reduce-scatters, once per FSDP unit (each block and the root). Reducing on every micro-step would give
    the same gradients, so only this count sees it."""
    tmp, ref, results = runs
    for result in results:
        assert result["fsdp_micro_steps"] == 2  # global 8 = micro 2 x 2 micro-steps x 2 ranks
        assert result["fsdp_units"] == 5  # 4 blocks and the root
        assert result["fsdp_reductions_per_step"] == [result["fsdp_units"]] * STEPS
    # Counting does not change the run: it matches one process.
    assert_matches_reference(tmp / "fsdp-counted", ref, check_grad_norm=True)


@pytest.mark.parametrize("name", list(SABOTAGE))
def test_layout_parity_check_catches_a_broken_reduction(name, runs):
    tmp, ref, _ = runs
    # The comparison test_layouts.py makes without the gradient norms (losses and final weights) ...
    with pytest.raises(AssertionError):
        assert_matches_reference(tmp / name, ref, check_grad_norm=False)
    # ... and with them, as test_layouts.py compares.
    with pytest.raises(AssertionError):
        assert_matches_reference(tmp / name, ref, check_grad_norm=True)


def test_sum_without_dividing_is_seen_plainly_in_the_gradient_norm(runs):
    """AdamW is nearly invariant to a constant gradient scale and clipping rescales the gradient anyway, so a
    missing 1/world_size shows in losses and weights only through AdamW's epsilon (a few 1e-10 here);
    the logged pre-clipping gradient norm shows it as a factor of exactly the world size."""
    tmp, ref, _ = runs
    ratio = torch.tensor(grad_norms(tmp / "sum-not-mean")) / torch.tensor(ref["grad_norms"])
    torch.testing.assert_close(ratio, torch.full_like(ratio, 2.0), rtol=1e-9, atol=0)
    first = losses(tmp / "sum-not-mean")[0]
    assert first == pytest.approx(ref["losses"][0], rel=1e-12)  # the first loss precedes any update


def test_ddp_bf16_gradient_reduction_is_active_and_close(tmp_path):
    """parallel.reduce_dtype bf16 under DDP: the all-reduce runs in bf16 (gradient norms move by bf16 rounding,
    ~1e-3, where the fp32 reduction agrees with one process to ~1e-7) and training still follows the reference."""
    train(tiny_config(tmp_path, **{"compute.precision": "fp32", "train.steps": 3}), tmp_path / "single")
    for dtype in ("fp32", "bf16"):
        dp2 = {"compute.precision": "fp32", "train.steps": 3, "parallel.dp": 2, "parallel.reduce_dtype": dtype}
        run_ranks(train_on_rank, 2, args=(str(tmp_path), dp2, dtype))
    ref = torch.tensor(grad_norms(tmp_path / "single"))
    err = {d: float(((torch.tensor(grad_norms(tmp_path / d)) - ref).abs() / ref).max()) for d in ("fp32", "bf16")}
    assert err["fp32"] < 1e-5, err
    assert 1e-5 < err["bf16"] < 2e-2, err
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "bf16")), torch.tensor(losses(tmp_path / "single")),
                               rtol=1e-2, atol=0)


# ----- the launcher itself: a failing or vanished rank fails the call, it does not hang it -------------

def _rank_one_raises(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one gives up")
    dist.barrier()  # rank 0 waits for a peer that never comes


def _rank_one_exits(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)  # no result, no traceback: as if killed
    dist.barrier()


def test_launcher_reports_a_rank_that_raises():
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*ValueError: rank one gives up"):
        run_ranks(_rank_one_raises, 2, timeout=60)


def test_launcher_reports_a_rank_that_exits_without_a_result():
    with pytest.raises(RuntimeError, match=r"rank 1 exited \(code 3\) without a result"):
        run_ranks(_rank_one_exits, 2, timeout=60)
