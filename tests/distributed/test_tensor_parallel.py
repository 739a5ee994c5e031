"""Tensor and sequence parallelism reproduce the single-process model (gloo ranks, float64).

One table of layouts, one parity test. Every layout builds the tiny Llama from the same seed, applies
`apply_tensor_parallel` (and, for the fsdp rows, FSDP2 on the other dimension of a 2-D mesh), and
trains 5 AdamW steps with gradient clipping on the same batches as the single-process model. Compared
with the single-process run: step-0 logits (gathered from the vocab shards), loss, every parameter's
gradient and the gradient norm, then the 5 losses and the final parameters. In float64 DTensor on
gloo agrees with one process to rounding (measured max relative difference ~1e-15); the tolerance
below is rtol 1e-10 / atol 1e-12.

Besides parity: the vocab-parallel loss never all-gathers the logits; sequence parallel divides by tp
the activation bytes the norms save for backward; layouts that tp does not divide raise LayoutError.
All multi-process cases of one world size run in one spawn (the fixture below), to keep the suite fast.

Through the real Trainer: what the optimizer reads on each tp rank is that rank's share of one process's
gradient, in the parameter's own placement. Without FSDP, sequence parallel leaves the norm weights'
gradients as pending sums (Partial) and the vocab-sharded embedding's replicated; the trainer settles them
before clipping (with FSDP on another mesh dimension its reduce-scatter already places every gradient).
A run that skips the settle still trains exactly like one process on torch 2.13, losses, gradient norms
and weights alike: DTensor redistributes a Partial gradient inside every AdamW op that reads it (27
all-reduces per optimizer step on the tiny config, against none once settled), so parity cannot see it,
while torch 2.11's AdamW stepped on each rank's unreduced share. Only the gradient the optimizer is
handed shows the difference on every release.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from fourfold.config import ModelConfig, OptimConfig
from fourfold.errors import LayoutError
from fourfold.testing import PARITY_OVERRIDES, tiny_config
from fourfold.train.trainer import Trainer
from tests.distributed.launcher import run_ranks

SEED, STEPS, BATCH, SEQ = 7, 5, 4, 16
MAX_NORM = 0.5  # below the initial gradient norm (checked), so every step clips
RTOL, ATOL = 1e-10, 1e-12
BASE_MODEL = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=32)
TRAIN = OptimConfig(lr=1e-2, weight_decay=0.1)


@dataclass(frozen=True)
class Layout:
    """One row of the table: ranks = tp * fsdp; `clip` names the clipping function the run uses."""

    tp: int
    fsdp: int = 1
    sequence_parallel: bool = True
    model: dict = field(default_factory=dict)
    clip: str = "torch"  # torch.nn.utils.clip_grad_norm_, or "fourfold": the trainer's clipping by mesh

    @property
    def ranks(self) -> int:
        return self.tp * self.fsdp


# Without sequence parallel the norm weights stay plain tensors next to DTensor weights; torch's
# clip_grad_norm_ cannot mix the two in one call, so those rows clip the way the trainer does.
LAYOUTS = {
    "tp2": Layout(tp=2, sequence_parallel=False, clip="fourfold"),
    "tp2-sp": Layout(tp=2),
    "tp2-sp-tied": Layout(tp=2, model={"tie_embeddings": True}, clip="fourfold"),
    "tp4-kv-split": Layout(tp=4, model={"dim": 64, "n_heads": 8, "n_kv_heads": 4}),
    "tp2-sp-fsdp2": Layout(tp=2, fsdp=2),
    "tp2-fsdp2": Layout(tp=2, fsdp=2, sequence_parallel=False, clip="fourfold"),
}


# ----- shared by the single process and the ranks ------------------------------------------------
def _model(overrides: dict):
    from fourfold.models.llama import Llama

    torch.manual_seed(SEED)
    return Llama(ModelConfig(**{**BASE_MODEL, **overrides})).double()


def _batches(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, vocab, (STEPS, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(SEED))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of `t`, gathering DTensor shards."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _clip(model, how: str) -> torch.Tensor:
    if how == "torch":
        return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
    from fourfold.parallel.grad_norm import clip_with_norm, total_grad_norm

    params = [p for p in model.parameters() if p.grad is not None]
    norm = total_grad_norm(params)
    clip_with_norm(params, MAX_NORM, norm)
    return norm


def _train(model, batches, tp: bool, clip: str, mean_over_data) -> dict:
    """STEPS AdamW steps with clipping; records step 0 in detail, then losses and final parameters."""
    from torch.distributed.tensor.debug import CommDebugMode

    from fourfold.parallel.tensor import compute_loss, loss_context, settle_partial_grads
    from fourfold.optim import build_adamw

    optimizer = build_adamw(model, TRAIN, torch.device("cpu"))
    record: dict = {"losses": []}
    for step, (inputs, targets) in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        with loss_context(tp):
            logits = model(inputs)
            with CommDebugMode() as comm:
                loss = compute_loss(logits, targets)
            loss.backward()
        if step == 0:
            record["logits"] = _full(logits)
            record["loss_collectives"] = sorted(str(op) for op in comm.get_comm_counts())
            record["grads"] = {n: _full(p.grad) for n, p in model.named_parameters()}
        settle_partial_grads(model.parameters())
        if step == 0:
            # What the optimizer reads: each rank's local gradient of every fully replicated parameter.
            record["replicated_local_grads"] = {
                n: p.grad.to_local().detach().clone() for n, p in model.named_parameters()
                if hasattr(p, "placements") and all(pl.is_replicate() for pl in p.placements)}
        norm = _clip(model, clip)
        if step == 0:
            record["grad_norm"] = float(_full(norm))
        optimizer.step()
        record["losses"].append(mean_over_data(_full(loss)))
    record["params"] = {n: _full(p) for n, p in model.named_parameters()}
    return record


def _norm_saved_bytes(model, tokens: torch.Tensor) -> tuple[int, int]:
    """(bytes the norms save for backward, bytes the whole forward saves) on this rank, one forward.

    DTensors count their local shard; parameters are not activations and are skipped; a tensor saved
    by several ops counts once.
    """
    from fourfold.models.llama import RMSNorm

    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    depth, seen, totals = [0], {}, {"norm": 0, "all": 0}

    def pack(t):
        if not (t.is_leaf and t.requires_grad) and id(t) not in seen:
            seen[id(t)] = t  # held, so the id is not reused while we count
            local = t.to_local() if hasattr(t, "to_local") else t
            nbytes = local.numel() * local.element_size()
            totals["all"] += nbytes
            totals["norm"] += nbytes if depth[0] else 0
        return t

    handles = [m.register_forward_pre_hook(lambda *_: depth.__setitem__(0, depth[0] + 1)) for m in norms]
    handles += [m.register_forward_hook(lambda *_: depth.__setitem__(0, depth[0] - 1)) for m in norms]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    for h in handles:
        h.remove()
    return totals["norm"], totals["all"]


# ----- what each rank runs ------------------------------------------------------------------------
def _apply_fsdp_for_test(model, fsdp_mesh) -> None:
    """FSDP2 the way fourfold.parallel.fsdp applies it: each block, then the root (embedding, norm, head)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers.values():
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)


def _run_layout(layout: Layout) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fourfold.parallel.tensor import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (layout.fsdp, layout.tp), mesh_dim_names=("fsdp", "tp"))
    model = apply_tensor_parallel(_model(layout.model), mesh["tp"], layout.sequence_parallel)
    tied = model.output.weight is model.tok_embeddings.weight
    shard, per_rank = mesh["fsdp"].get_local_rank(), BATCH // layout.fsdp
    if layout.fsdp > 1:
        # TP first, then FSDP on the other mesh dimension: fully_shard shards the tp DTensors further.
        _apply_fsdp_for_test(model, mesh["fsdp"])
    batches = [(x[shard * per_rank:(shard + 1) * per_rank], y[shard * per_rank:(shard + 1) * per_rank])
               for x, y in _batches(model.cfg.vocab_size)]

    def mean_over_data(loss: torch.Tensor) -> float:
        dist.all_reduce(loss, group=mesh["fsdp"].get_group())
        return float(loss) / layout.fsdp

    record = _train(model, batches, True, layout.clip, mean_over_data)
    record.update(tied=tied, rows=(shard * per_rank, (shard + 1) * per_rank))
    return record


def _run_memory(tp: int) -> dict:
    """Norm-region saved bytes with and without sequence parallel on this rank."""
    from torch.distributed.device_mesh import init_device_mesh

    from fourfold.parallel.tensor import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (tp,))
    tokens = _batches(BASE_MODEL["vocab_size"])[0][0]
    return {sp: _norm_saved_bytes(apply_tensor_parallel(_model({}), mesh, sp), tokens) for sp in (False, True)}


def _run_odd_sequence(tp: int) -> str:
    """The message sequence parallel raises for a sequence tp does not divide."""
    from torch.distributed.device_mesh import init_device_mesh

    from fourfold.parallel.tensor import apply_tensor_parallel

    model = apply_tensor_parallel(_model({}), init_device_mesh("cpu", (tp,)), True)
    try:
        model(torch.zeros(1, tp * 3 + 1, dtype=torch.long))
    except LayoutError as e:
        return str(e)
    return ""


def _rank_main(rank: int, world: int, names: list[str]) -> dict:
    out = {name: _run_layout(LAYOUTS[name]) for name in names}
    if world == 2:
        out["memory"] = _run_memory(world)
        out["odd_sequence"] = _run_odd_sequence(world)
    return out


# ----- the tests ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rank_results():
    """results(world) -> one dict per rank, holding every layout of that world size (spawned once)."""
    cache: dict[int, list] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            names = [n for n, layout in LAYOUTS.items() if layout.ranks == world]
            cache[world] = run_ranks(_rank_main, world, (names,))
        return cache[world]

    return get


@pytest.fixture(scope="module")
def references():
    """Single-process runs on the whole batch, one per model shape."""
    cache: dict = {}

    def get(layout: Layout) -> dict:
        key = (tuple(sorted(layout.model.items())), layout.clip)
        if key not in cache:
            model = _model(layout.model)
            cache[key] = _train(model, _batches(model.cfg.vocab_size), False, layout.clip, float)
        return cache[key]

    return get


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if layout.ranks > 2 else ())
                                  for n, layout in LAYOUTS.items()])
def test_layout_matches_single_process(name, rank_results, references):
    layout = LAYOUTS[name]
    ref = references(layout)
    assert ref["grad_norm"] > MAX_NORM, "MAX_NORM must be below the gradient norm, or clipping goes untested"
    for rank, result in enumerate(rank_results(layout.ranks)):
        got = result[name]
        lo, hi = got["rows"]
        _close(got["logits"], ref["logits"][lo:hi], f"rank {rank} logits")
        _close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), f"rank {rank} losses (data mean)")
        assert got["grads"].keys() == ref["grads"].keys()
        for pname, grad in got["grads"].items():
            _close(grad, ref["grads"][pname], f"rank {rank} grad of {pname}")
        if layout.sequence_parallel and layout.fsdp == 1:
            assert got["replicated_local_grads"], "sequence parallel should leave replicated norm weights"
        for pname, grad in got["replicated_local_grads"].items():
            # Sequence parallel leaves the norms' gradients as pending sums; settled, every rank holds the sum.
            _close(grad, ref["grads"][pname], f"rank {rank} local grad of replicated {pname}")
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=RTOL)
        for pname, value in got["params"].items():
            _close(value, ref["params"][pname], f"rank {rank} {pname} after {STEPS} steps")
        assert got["tied"] == bool(layout.model.get("tie_embeddings"))


# ----- through the trainer: the gradients the optimizer reads -------------------------------------
def _placement_codes(t) -> tuple[str, ...] | None:
    """'S<dim>' / 'R' / 'P' per mesh dimension of a DTensor; None for a plain tensor."""
    if not hasattr(t, "placements"):
        return None
    return tuple(f"S{p.dim}" if p.is_shard() else "R" if p.is_replicate() else "P" for p in t.placements)


def _optimizer_inputs(rank: int, world: int, tmp: str, overrides: dict, run: str) -> list[dict]:
    """Train with the real Trainer; at every optimizer step record, per parameter, this rank's local
    gradient, the gradient's and the parameter's placements and this rank's mesh coordinate."""
    trainer = Trainer(tiny_config(Path(tmp), **overrides), Path(tmp) / run)
    seen: list[dict] = []

    def record(*_):
        seen.append({name: ((p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().clone(),
                            _placement_codes(p.grad), _placement_codes(p),
                            tuple(p.device_mesh.get_coordinate()) if hasattr(p, "device_mesh") else None)
                     for name, p in trainer.model.named_parameters()})

    trainer.optimizer.register_step_pre_hook(record)
    trainer.run()
    return seen


def _share(full: torch.Tensor, placements: tuple[str, ...] | None, coordinate, mesh_shape) -> torch.Tensor:
    """The part of `full` a rank at `coordinate` holds under `placements` (even splits only)."""
    for code, index, size in zip(placements or (), coordinate or (), mesh_shape):
        if code.startswith("S"):
            full = full.chunk(size, dim=int(code[1:]))[index]
    return full


def test_trainer_hands_the_optimizer_each_ranks_share_of_one_process_gradient(tmp_path):
    tp, steps = 2, 2
    overrides = {**PARITY_OVERRIDES, "train.steps": steps}
    reference = _optimizer_inputs(0, 1, str(tmp_path), overrides, "single")
    ranks = run_ranks(_optimizer_inputs, tp, args=(str(tmp_path), {**overrides, "parallel.tp": tp}, "tp2-sp"))
    assert len(reference) == steps and all(len(r) == steps for r in ranks)
    for rank, seen in enumerate(ranks):
        for step, (got, ref) in enumerate(zip(seen, reference)):
            assert got.keys() == ref.keys()
            for name, (local, grad_placements, placements, coordinate) in got.items():
                where = f"rank {rank} step {step} {name}"
                assert placements is not None, f"{where}: tp should make every parameter a DTensor"
                assert grad_placements == placements, f"{where}: gradient {grad_placements}, parameter {placements}"
                _close(local, _share(ref[name][0], placements, coordinate, (tp,)), where)
    # Under sequence parallel the norm weights are replicated DTensors: the parameters whose backward leaves
    # pending sums to settle.
    assert any(codes == ("R",) and "norm" in name for name, (_, _, codes, _) in ranks[0][0].items())


@pytest.mark.parametrize("name", ["tp2", "tp2-sp"])
def test_vocab_parallel_loss_never_gathers_logits(name, rank_results):
    for result in rank_results(LAYOUTS[name].ranks):
        collectives = result[name]["loss_collectives"]
        assert collectives, "the vocab-parallel loss must reduce across tp ranks"
        assert all("all_reduce" in op for op in collectives), collectives


def test_sequence_parallel_divides_norm_activations_by_tp(rank_results):
    tp = 2
    single_norm, _ = _norm_saved_bytes(_model({}), _batches(BASE_MODEL["vocab_size"])[0][0])
    for result in rank_results(tp):
        (plain_norm, plain_all), (sp_norm, sp_all) = result["memory"][False], result["memory"][True]
        assert plain_norm == single_norm  # without SP every tp rank holds the whole sequence
        assert sp_norm * tp == plain_norm
        assert sp_all < plain_all


def test_sequence_parallel_rejects_indivisible_sequence(rank_results):
    for result in rank_results(2):
        assert "multiple of 2" in result["odd_sequence"]


@pytest.mark.parametrize("key, value", [("n_kv_heads", 1), ("ffn_dim", 65), ("vocab_size", 63)])
def test_tp_must_divide_split_dimensions(key, value):
    from fourfold.layout import check_tensor_parallel

    cfg = ModelConfig(**{**BASE_MODEL, key: value})
    with pytest.raises(LayoutError, match=f"model.{key}"):
        check_tensor_parallel(cfg, 2)
    check_tensor_parallel(ModelConfig(**BASE_MODEL), 2)


def test_loss_context_is_a_no_op_without_tp():
    from fourfold.parallel.tensor import compute_loss, loss_context

    logits, targets = torch.randn(2, 3, 8, dtype=torch.float64), torch.randint(0, 8, (2, 3))
    assert isinstance(loss_context(False), contextlib.nullcontext)
    with loss_context(False):
        loss = compute_loss(logits, targets)
    _close(loss, torch.nn.functional.cross_entropy(logits.reshape(6, 8), targets.reshape(6)), "loss")
