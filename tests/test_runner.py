"""The step runner's interface on one process: a step is the hand-written accumulation, clip and mean loss;
the factory picks the pipeline runner exactly when the mesh has pipeline stages."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fourfold.mesh import ParallelMesh
from fourfold.models.llama import Llama
from fourfold.parallel.data_parallel import build_data_parallel
from fourfold.train.runner import PipelineRunner, PlainRunner, build_runner, runner_class
from tests.trainer_helpers import tiny_config

CLIP = 0.05  # small enough that the tiny model's first gradient is clipped


@pytest.fixture
def setup(tmp_path):
    cfg = tiny_config(tmp_path, **{"compute.precision": "fp64", "optim.grad_clip": CLIP})
    torch.manual_seed(0)
    model = Llama(cfg.model).double()
    reference = copy.deepcopy(model)
    mesh = ParallelMesh.build(cfg)
    runner = build_runner(cfg, mesh, build_data_parallel(mesh, cfg.parallel, cfg.optim, torch.device("cpu")),
                          [model], torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len + 1), generator=gen)
        batches.append((ids[:, :-1], ids[:, 1:]))
    return runner, reference, batches


def _loss(model, inputs, targets) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_plain_step_is_accumulated_mean_loss_backward_then_clip(setup):
    runner, reference, batches = setup
    assert isinstance(runner, PlainRunner) and runner.model is runner.chunks[0]

    loss, grad_norm, skipped = runner.step(batches)

    losses = []
    for inputs, targets in batches:  # by hand: the mean loss's gradient, accumulated micro-batch by micro-batch
        micro_loss = _loss(reference, inputs, targets)
        (micro_loss / len(batches)).backward()
        losses.append(micro_loss.detach())
    grads = [p.grad for p in reference.parameters()]
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
    coef = min(1.0, CLIP / (float(norm) + 1e-6))

    assert not skipped and coef < 1.0
    torch.testing.assert_close(loss, torch.stack(losses).mean(), rtol=1e-12, atol=0)
    torch.testing.assert_close(grad_norm, norm, rtol=1e-12, atol=0)
    for (name, p), g in zip(runner.model.named_parameters(), grads):
        torch.testing.assert_close(p.grad, g * coef, rtol=1e-10, atol=1e-14, msg=lambda m: f"{name}: {m}")


def test_plain_evaluate_is_the_mean_validation_loss(setup):
    runner, reference, batches = setup
    with torch.no_grad():
        expected = torch.stack([_loss(reference, x, y) for x, y in batches]).mean()
    got = runner.evaluate(batches)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
    assert runner.global_mean(got) == float(got)  # one process: nothing to average
    assert all(p.grad is None for p in runner.model.parameters())
    assert runner.checkpoint_modules is runner.model and runner.checkpoint_shard == (True, "model")


@pytest.mark.parametrize("sizes, expected", [
    ({}, PlainRunner),
    ({"dp": 2, "fsdp": 2, "cp": 2, "tp": 2}, PlainRunner),
    ({"pp": 2}, PipelineRunner),
    ({"pp": 2, "fsdp": 2, "tp": 2}, PipelineRunner),
])
def test_factory_picks_the_pipeline_runner_exactly_for_pipeline_stages(sizes, expected):
    full = {"pp": 1, "dp": 1, "fsdp": 1, "cp": 1, "tp": 1, **sizes}
    world = 1
    for size in full.values():
        world *= size
    assert runner_class(ParallelMesh(sizes=full, world_size=world)) is expected
