"""Activation recomputation: every mode trains like no recomputation, keeps fewer bytes, and keeps the names."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fourfold.config import ModelConfig
from fourfold.models.llama import Llama
from fourfold.recompute import apply_recompute, recomputed_blocks, saved_activation_bytes

CFG = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=96, max_seq_len=64)
MODES = ["none", "full", "every-2", "selective"]


@pytest.fixture(scope="module")
def runs():
    """Per mode: (loss, gradients by name, saved-activation bytes, state-dict keys) of one forward/backward."""
    torch.manual_seed(0)
    base = Llama(CFG)
    tokens = torch.randint(0, CFG.vocab_size, (2, 33))
    out = {}
    for mode in MODES:
        model = apply_recompute(copy.deepcopy(base), mode)
        loss, saved = saved_activation_bytes(
            lambda: F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out[mode] = (loss.detach(), grads, saved, list(model.state_dict()))
    return out


@pytest.mark.parametrize("mode", MODES[1:])
def test_same_loss_and_gradients_as_no_recompute(runs, mode):
    loss, grads, _, _ = runs[mode]
    ref_loss, ref_grads, _, _ = runs["none"]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_saved_bytes_fall_as_documented(runs):
    saved = {mode: runs[mode][2] for mode in MODES}
    # full keeps one block input per block; every-2 recomputes half the blocks; selective drops the
    # element-wise outputs of every block but keeps the matmuls.
    assert saved["none"] > saved["every-2"] > saved["full"]
    assert saved["none"] > saved["selective"] > saved["full"]
    per_block_none = saved["none"] - saved["full"]
    assert saved["every-2"] == pytest.approx(saved["full"] + per_block_none / 2, rel=0.1)
    assert saved["selective"] < saved["none"] - 0.3 * per_block_none


def test_parameter_names_unchanged(runs):
    assert all(runs[mode][3] == runs["none"][3] for mode in MODES)


def test_which_blocks_each_mode_recomputes():
    assert recomputed_blocks("none", 4) == []
    assert recomputed_blocks("full", 3) == [0, 1, 2]
    assert recomputed_blocks("every-3", 7) == [0, 3, 6]
    with pytest.raises(ValueError, match="every-N"):
        recomputed_blocks("sometimes", 2)


def test_recompute_summary_predicts_saving_and_extra_flops():
    import dataclasses

    from fourfold.config import build_config
    from fourfold.models.llama import training_flops_per_token
    from fourfold.plan.memory import estimate_memory
    from fourfold.plan.recompute_cost import block_forward_flops_per_token, recompute_summary, without_recompute

    flat = {"model.preset": "llama-1b", "train.seq_len": "2048", "train.micro_batch": "4", "train.global_batch": "4",
            "compute.precision": "bf16", "compute.device": "cuda"}
    base = build_config({}, flat)
    m = base.model
    # The blocks' forward FLOPs (x3 for forward + backward) plus the head and norms are the MFU total.
    head_and_norms = 6.0 * (m.dim * m.vocab_size + (2 * m.n_layers + 1) * m.dim)
    assert 3 * m.n_layers * block_forward_flops_per_token(m, 2048) + head_and_norms == pytest.approx(
        training_flops_per_token(m, 2048))

    none_act = estimate_memory(base, 1).activations
    summaries = {}
    for mode in ("full", "selective", "every-2"):
        cfg = dataclasses.replace(base, compute=dataclasses.replace(base.compute, recompute=mode))
        assert without_recompute(cfg) == base  # the baseline differs from cfg in the recompute mode only
        s = summaries[mode] = recompute_summary(cfg, estimate_memory(cfg, 1), estimate_memory(without_recompute(cfg), 1))
        assert s.activations_without == none_act
        assert s.activations == estimate_memory(cfg, 1).activations
        assert 0 < s.saved_bytes < none_act
        assert mode in s.line() and "saves" in s.line()
    # Full recompute repeats every block's forward: about a third of the step's FLOPs; every-2 half of that.
    assert 0.25 < summaries["full"].extra_flops_fraction < 1 / 3
    assert summaries["every-2"].extra_flops_fraction == pytest.approx(summaries["full"].extra_flops_fraction / 2)
    assert summaries["selective"].extra_flops_fraction == 0
    assert summaries["full"].saved_bytes > summaries["selective"].saved_bytes > 0
