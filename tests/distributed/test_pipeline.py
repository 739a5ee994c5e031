"""Pipeline parallelism reproduces one process: stage split, split backward, and the executor on gloo ranks.

Parity (float64, tolerance 1e-10): for each layout, N gloo ranks split the same tiny Llama, run one
step's forward + backward through `PipelineExecutor` on m micro-batches, and send back the loss and
every parameter's gradient; these must equal the single-process model's on the same micro-batches
(gradient of the mean loss). The same processes then take 5 AdamW steps (new micro-batches each
step); losses and final parameters must equal single-process training. Each run also returns its
forward-only (validation) loss and writes the gathered timeline as a Chrome trace and a picture.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fourfold.config import ModelConfig, OptimConfig
from fourfold.errors import LayoutError
from fourfold.models.llama import Llama
from fourfold.ops.cross_entropy import cross_entropy
from fourfold.parallel.pipeline import (PipelineExecutor, analytic_bubble, draw_timeline, measured_bubble,
                                        split_pipeline, stage_layer_counts, write_chrome_trace)
from fourfold.parallel.pipeline.executor import _SplitBackward
from fourfold.parallel.pipeline.timeline import gather_timelines
from fourfold.optim import build_adamw
from tests.distributed.launcher import run_ranks

TOL = dict(rtol=1e-10, atol=1e-10)
STEPS = 5
MICRO_SHAPE = (2, 8)  # sequences per micro-batch, tokens per sequence
LOSS = functools.partial(cross_entropy, chunk=0)

# name -> (pp, vpp, schedule, micro-batches per step, model layers)
LAYOUTS = {
    "pp2-1f1b": (2, 1, "1f1b", 4, 4),
    "pp2-gpipe": (2, 1, "gpipe", 3, 4),
    "pp2-zero-bubble": (2, 1, "zero-bubble", 4, 4),
    "pp2-vpp2-interleaved": (2, 2, "interleaved-1f1b", 4, 4),
    "pp4-1f1b": (4, 1, "1f1b", 4, 4),
    "pp4-zero-bubble": (4, 1, "zero-bubble", 8, 4),
}
# Every case takes about a second, so none is marked slow. pp4 matters: it is the smallest pipeline whose
# previous and next stages are different ranks, so a send to the wrong neighbour (or a receive from it)
# passes every pp2 case and hangs pp4 until the process group times out (CASE_TIMEOUT).
CASE_TIMEOUT = 60  # seconds


def model_config(n_layers: int = 4) -> ModelConfig:
    return ModelConfig(dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)


def train_config() -> OptimConfig:
    return OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=0)


def make_model(n_layers: int = 4) -> Llama:
    torch.manual_seed(0)
    return Llama(model_config(n_layers)).double()


def micro_batches(step: int, n_micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randint(0, 64, MICRO_SHAPE, generator=g), torch.randint(0, 64, MICRO_SHAPE, generator=g))
            for _ in range(n_micro)]


def single_process(n_micro: int, n_layers: int) -> dict:
    """The reference: gradient of the mean micro-batch loss, then STEPS AdamW steps."""
    model = make_model(n_layers)
    optimizer = build_adamw(model, train_config(), torch.device("cpu"))
    out = {"losses": []}
    for step in range(STEPS):
        batches = micro_batches(step, n_micro)
        total = 0.0
        for inputs, targets in batches:
            loss = LOSS(model(inputs), targets)
            (loss / n_micro).backward()
            total += loss.item()
        out["losses"].append(total / n_micro)
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _pipeline_rank(rank: int, world: int, vpp: int, schedule: str, n_micro: int, n_layers: int, out_dir: str,
                   draw: bool) -> dict:
    import torch.distributed as dist

    chunks = split_pipeline(make_model(n_layers), rank, world, vpp)
    executor = PipelineExecutor(chunks, schedule, rank, world, vpp, n_micro, dist.group.WORLD, LOSS,
                                torch.device("cpu"), torch.float64)
    optimizer = build_adamw(torch.nn.ModuleList(chunks), train_config(), torch.device("cpu"))
    result = {"losses": [], "eval_loss": executor.evaluate(micro_batches(0, n_micro))}
    for step in range(STEPS):
        loss = executor.step(micro_batches(step, n_micro))
        result["losses"].append(None if loss is None else loss.item())
        if step == 0:
            result["grads"] = {n: p.grad.numpy().copy() for c in chunks for n, p in c.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    result["params"] = {n: p.detach().numpy().copy() for c in chunks for n, p in c.named_parameters()}
    if result["eval_loss"] is not None:
        result["eval_loss"] = result["eval_loss"].item()
    timelines = gather_timelines(executor.last_timeline, executor.last_step_began, dist.group.WORLD)
    result["bubbles"] = [measured_bubble(t) for t in timelines]
    if rank == 0:
        write_chrome_trace(timelines, f"{out_dir}/trace.json")
        if draw:
            draw_timeline(timelines, f"{out_dir}/timeline.png", f"{schedule}, pp={world}, vpp={vpp}, m={n_micro}")
    return result


@functools.lru_cache(maxsize=None)
def _reference(n_micro: int, n_layers: int) -> dict:
    return single_process(n_micro, n_layers)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_matches_single_process(name, tmp_path):
    pp, vpp, schedule, n_micro, n_layers = LAYOUTS[name]
    ref = _reference(n_micro, n_layers)
    draw = name == "pp2-zero-bubble"
    results = run_ranks(_pipeline_rank, pp, args=(vpp, schedule, n_micro, n_layers, str(tmp_path), draw),
                        timeout=CASE_TIMEOUT)
    last = results[-1]
    assert all(r["losses"] == [None] * STEPS and r["eval_loss"] is None for r in results[:-1])
    # One step: the loss and every parameter's gradient, each parameter held by exactly one rank.
    assert last["eval_loss"] == pytest.approx(ref["losses"][0], rel=1e-12)
    torch.testing.assert_close(torch.tensor(last["losses"][0]), torch.tensor(ref["losses"][0]), **TOL)
    owners = [n for r in results for n in r["grads"]]
    assert sorted(owners) == sorted(ref["grads"]), "each parameter must live on exactly one stage"
    for r in results:
        for n, g in r["grads"].items():
            torch.testing.assert_close(torch.from_numpy(g), ref["grads"][n], **TOL, msg=lambda m: f"grad {n}: {m}")
    # Five AdamW steps: losses and final parameters.
    torch.testing.assert_close(torch.tensor(last["losses"]), torch.tensor(ref["losses"]), **TOL)
    for r in results:
        for n, p in r["params"].items():
            torch.testing.assert_close(torch.from_numpy(p), ref["params"][n], **TOL, msg=lambda m: f"param {n}: {m}")
    # The timeline of the last step was gathered, written and measured.
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X"} == set(range(pp))
    assert all(0.0 <= b < 1.0 for b in results[0]["bubbles"])
    if draw:
        assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert analytic_bubble(schedule, pp, vpp, n_micro) > 0


# ----- single-process pieces -------------------------------------------------------------------------
def test_split_keeps_names_owners_and_forward():
    model = make_model(4)
    names = dict(model.named_parameters())
    x = torch.randint(0, 64, MICRO_SHAPE)
    for pp, vpp, layers in [(2, 1, None), (2, 2, None), (4, 1, None), (2, 1, [1, 3]), (2, 2, [1, 1, 1, 1])]:
        stages = {}
        for rank in range(pp):
            for c, chunk in enumerate(split_pipeline(model, rank, pp, vpp, layers)):
                stages[c * pp + rank] = chunk
        seen = []
        h = x
        for s in range(pp * vpp):
            chunk = stages[s]
            assert (chunk.tok_embeddings is not None) == (s == 0)
            assert (chunk.output is not None and chunk.norm is not None) == (s == pp * vpp - 1)
            for n, p in chunk.named_parameters():
                assert torch.equal(p, names[n]) and p is not names[n]
                seen.append(n)
            h = chunk(h)
        assert sorted(seen) == sorted(names), (pp, vpp, layers)
        torch.testing.assert_close(h, model(x), rtol=0, atol=0)
    counts = [len(c.layers) for r in range(2) for c in split_pipeline(model, r, 2, 1, [1, 3])]
    assert counts == [1, 3] and list(split_pipeline(model, 1, 2, 1, [1, 3])[0].layers) == ["1", "2", "3"]


def test_split_rejects_bad_layer_counts():
    with pytest.raises(LayoutError, match="parallel.pp_layers"):
        stage_layer_counts(6, 4, 1)
    with pytest.raises(LayoutError, match="summing to model.n_layers"):
        stage_layer_counts(4, 2, 1, [1, 2])
    with pytest.raises(LayoutError, match="pp \\* vpp = 4"):
        stage_layer_counts(4, 2, 2, [2, 2])


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_split_backward_equals_full_backward_without_extra_work():
    """BI then BW give the full backward's input and weight gradients, with the same number of matmuls."""
    chunk = split_pipeline(make_model(4), 1, 2, 1)[0]  # a last stage: blocks 2, 3, norm, head, loss
    x = torch.randn(*MICRO_SHAPE, 32, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 64, MICRO_SHAPE)
    with _CountMatmuls() as full:
        LOSS(chunk(x), targets).backward()
    want = {n: p.grad.clone() for n, p in chunk.named_parameters()}
    want_x = x.grad.clone()
    chunk.zero_grad(set_to_none=True)
    loss = LOSS(chunk(x), targets)
    split = _SplitBackward(loss, x, list(chunk.parameters()))
    with _CountMatmuls() as counted:
        grad_x = split.input_grad(None)
        assert all(p.grad is None for p in chunk.parameters()), "BI must not produce weight gradients"
        split.weight_grads()
    torch.testing.assert_close(grad_x, want_x, rtol=0, atol=0)
    for n, p in chunk.named_parameters():
        torch.testing.assert_close(p.grad, want[n], **TOL, msg=lambda m: f"{n}: {m}")
    with torch.no_grad(), _CountMatmuls() as forward:
        chunk(x)
    assert counted.count == full.count - forward.count > 0


def test_executor_checks_its_inputs():
    chunks = split_pipeline(make_model(4), 0, 1, 1)
    with pytest.raises(LayoutError, match="needs the pp process group"):
        PipelineExecutor(split_pipeline(make_model(4), 0, 2, 1), "1f1b", 0, 2, 1, 2, None, LOSS,
                         torch.device("cpu"), torch.float64)
    executor = PipelineExecutor(chunks, "1f1b", 0, 1, 1, 2, None, LOSS, torch.device("cpu"), torch.float64)
    with pytest.raises(LayoutError, match="built for 2 micro-batches"):
        executor.step(micro_batches(0, 3))
    ref = _reference(2, 4)
    loss = executor.step(micro_batches(0, 2))  # pp = 1: the executor is plain gradient accumulation
    torch.testing.assert_close(loss, torch.tensor(ref["losses"][0], dtype=torch.float64), **TOL)
    for n, p in chunks[0].named_parameters():
        torch.testing.assert_close(p.grad, ref["grads"][n], **TOL)
    assert len(executor.last_timeline) == 4 and not np.isnan(measured_bubble(executor.last_timeline))
