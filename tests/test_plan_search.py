"""The layout search proposes exactly the layouts the trainer accepts, deterministically, fastest first.

Brute force: every (pp, dp, fsdp, cp, tp) whose product is the world size (tp inside a node), every vpp,
schedule and ZeRO stage of the space, checked with the trainer's own `validate_layout`; the search must
return that set, no more, no less.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from fourfold.config import build_config
from fourfold.errors import ConfigError, LayoutError
from fourfold.layout import validate_layout
from fourfold.plan.hardware import load_hardware
from fourfold.plan.predict import predict
from fourfold.plan.report import describe, layout_overrides
from fourfold.plan.search import SearchSpace, make_candidate, enumerate_layouts, rank_layouts

SMALL = SearchSpace(micro_batches=(1, 2), recompute=("none", "full"), float8=(False,), compile=(False,),
                    sequence_parallel=(True, False), vpp=(1, 2), max_cp=4, max_pp=4)


def _base(**over):
    flat = {"model.n_layers": 4, "model.dim": 64, "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_dim": 128,
            "model.vocab_size": 256, "model.max_seq_len": 64, "train.seq_len": 64, "train.global_batch": 8,
            "compute.precision": "bf16", "compute.device": "cuda"}
    flat.update(over)
    return build_config({}, {k: str(v) for k, v in flat.items()})


def _key(cfg) -> tuple:
    p = cfg.parallel
    return (p.pp, p.dp, p.fsdp, p.cp, p.tp, p.vpp, p.pp_schedule, p.zero, p.sequence_parallel, cfg.train.micro_batch,
            cfg.compute.recompute, cfg.quant.float8, cfg.compute.compile)


def _brute_force(base, world: int, space: SearchSpace, per_node: int) -> set:
    found = set()
    divs = [d for d in range(1, world + 1) if world % d == 0]
    for pp, dp, fsdp, cp, tp in itertools.product(divs, repeat=5):
        if pp * dp * fsdp * cp * tp != world or tp > per_node or cp > space.max_cp or pp > space.max_pp:
            continue
        for vpp, schedule, zero, mb, sp, rc in itertools.product(
                space.vpp, space.schedules, (1, 2, 3), space.micro_batches, space.sequence_parallel, space.recompute):
            if (pp == 1 and (vpp, schedule) != (1, "1f1b")) or (fsdp == 1 and zero != 3) or (tp == 1 and not sp):
                continue
            cfg = make_candidate(base, tp, cp, pp, vpp, schedule, {"dp": dp, "fsdp": fsdp, "zero": zero}, mb, sp, rc,
                                 False, False)
            for param_dtype in ("fp32", "bf16"):  # valid with either: the search must propose it
                try:
                    validate_layout(dataclasses.replace(cfg, parallel=dataclasses.replace(
                        cfg.parallel, param_dtype=param_dtype)), world)
                except (LayoutError, ConfigError):
                    continue
                found.add(_key(cfg))
    return found


@pytest.mark.parametrize("world, per_node", [(2, 2), (4, 4), (4, 2), (8, 4)])
def test_search_returns_exactly_the_valid_layouts(world, per_node):
    base = _base()
    layouts = enumerate_layouts(base, world, SMALL, per_node)
    keys = [_key(c) for c in layouts]
    assert len(keys) == len(set(keys)), "a layout is proposed twice"
    for cfg in layouts:
        validate_layout(cfg, world)  # nothing proposed is refused
        assert cfg.parallel.tp <= per_node
    assert set(keys) == _brute_force(base, world, SMALL, per_node)


def test_tied_embeddings_exclude_pipelines_and_odd_layers_exclude_uneven_splits():
    tied = enumerate_layouts(_base(**{"model.tie_embeddings": "true"}), 4, SMALL, 4)
    assert tied and all(c.parallel.pp == 1 for c in tied)
    three = enumerate_layouts(_base(**{"model.n_layers": 3}), 4, SMALL, 4)
    assert {c.parallel.pp * c.parallel.vpp for c in three} == {1, 2}  # no 4 stages for 3 blocks
    assert {tuple(c.parallel.pp_layers or ()) for c in three} == {(), (2, 1)}


def test_search_is_deterministic_and_ranked_by_predicted_time():
    hw = load_hardware(calibration=False)
    base = _base()
    first, total, _ = rank_layouts(base, 4, hw, "h100", 4, "ib400", top=6, space=SMALL)
    again, total2, _ = rank_layouts(base, 4, hw, "h100", 4, "ib400", top=6, space=SMALL)
    assert total == total2 and [layout_overrides(r.cfg) for r in first] == [layout_overrides(r.cfg) for r in again]
    times = [r.prediction.step.seconds for r in first]
    assert times == sorted(times) and len(first) == 6
    assert all(r.prediction.fits for r in first)


def test_layouts_that_do_not_fit_are_dropped():
    hw = load_hardware(calibration=False)
    base = build_config({}, {"model.preset": "llama3-8b", "train.seq_len": "4096", "train.global_batch": "8",
                             "compute.precision": "bf16", "compute.device": "cuda"})
    space = SearchSpace(micro_batches=(1, 8), recompute=("none", "full"), float8=(False,), vpp=(1,),
                        schedules=("1f1b",), sequence_parallel=(True,))
    ranked, _, _ = rank_layouts(base, 2, hw, "h100", 2, "ib400", top=50, space=space)
    assert ranked and all(r.prediction.needed_bytes <= r.prediction.device_bytes for r in ranked)
    # 8B on one 80 GB GPU cannot hold fp32 weights, gradients and AdamW state (128 GB): nothing fits
    assert rank_layouts(base, 1, hw, "h100", 1, "ib400", top=5, space=space)[0] == []
    # the same layout on a GPU with more memory is kept
    assert rank_layouts(base, 2, hw, "h200", 2, "ib400", top=50, space=space)[0][0].prediction.fits


def test_describe_names_every_dimension():
    cfg = make_candidate(_base(), 2, 2, 2, 2, "interleaved-1f1b", {"dp": 2, "fsdp": 2, "zero": 3}, 1, False, "full", False,
                False)
    text = describe(cfg)
    assert "tp2" in text and "cp2" in text and "pp2x2 interleaved-1f1b" in text and "hsdp 2x2" in text
    assert "no-sp" in text


def test_prediction_prefers_what_the_measurements_prefer():
    """On one 2-GPU node at the 1.1B benchmark shape: FSDP before DDP before tensor parallel (eager), as measured."""
    hw = load_hardware(calibration=False)
    base = build_config({}, {"model.preset": "llama-1b", "train.seq_len": "2048", "train.micro_batch": "4",
                             "train.global_batch": "8", "compute.precision": "bf16", "compute.device": "cuda"})
    fsdp = build_config({}, {**_flat(base), "parallel.fsdp": "2", "parallel.param_dtype": "bf16"})
    ddp = build_config({}, {**_flat(base), "parallel.dp": "2"})
    tp = build_config({}, {**_flat(base), "parallel.tp": "2", "train.global_batch": "4"})
    t = {name: predict(c, 2, hw, "h200", 8).tokens_per_s_per_gpu for name, c in
         (("fsdp", fsdp), ("ddp", ddp), ("tp", tp))}
    assert t["fsdp"] > t["ddp"] > t["tp"]


def _flat(cfg) -> dict:
    return {"model.preset": "llama-1b", "train.seq_len": str(cfg.train.seq_len), "train.micro_batch":
            str(cfg.train.micro_batch), "train.global_batch": str(cfg.train.global_batch), "compute.precision": "bf16",
            "compute.device": "cuda"}
