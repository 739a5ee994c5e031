"""GPTQ post-training quantization (fourfold.quant.gptq, ptq(method="gptq")): lower output error than round to
nearest on the calibration inputs, the same packed format, the same numbers as round to nearest when inputs are
uncorrelated, and a clear error without calibration data."""

from __future__ import annotations

import copy

import pytest
import torch

from fourfold.checkpoint.store import load_checkpoint, read_meta, save_checkpoint
from fourfold.config import ModelConfig
from fourfold.errors import ConfigError
from fourfold.models.llama import Llama
from fourfold.quant.fake_quant import dequantize_weight, quantize_weight
from fourfold.quant.gptq import block_inputs, gptq_modules, gptq_quantize, input_hessians
from fourfold.quant.packing import Int4WeightLinear, Int8WeightLinear, pack_int4
from fourfold.quant.qat import apply_checkpoint_quant, ptq, quant_meta, quant_targets
from fourfold.quant.schemes import scheme_by_name

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=320, max_seq_len=32)
SCHEMES = ["int4-g32", "int4-g64-asym", "8da4w-g32", "int8"]


def _model(seed: int = 0) -> Llama:
    model = Llama(CFG)
    model.init_weights(seed)
    return model


def _batches(n: int = 4, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (2, 16), generator=g) for _ in range(n)]


def _correlated_inputs(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose features are strongly correlated (a few latent directions plus a little noise)."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(rows, k // 8, generator=g) @ torch.randn(k // 8, k, generator=g)
    return latent + 0.1 * torch.randn(rows, k, generator=g)


def _output_error(x, w, q, scales, zeros, scheme) -> float:
    return float(((x @ (w - dequantize_weight(q, scales, zeros, scheme)).T) ** 2).sum())


@pytest.mark.parametrize("name", SCHEMES)
def test_gptq_output_error_is_well_below_round_to_nearest(name):
    scheme = scheme_by_name(name)
    x = _correlated_inputs(512, 128)
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    rtn = _output_error(x, w, *quantize_weight(w, scheme), scheme)
    gptq = _output_error(x, w, *gptq_quantize(w, x.T @ x / x.shape[0], scheme), scheme)
    assert gptq < 0.8 * rtn


@pytest.mark.parametrize("name", SCHEMES)
def test_gptq_with_uncorrelated_inputs_is_round_to_nearest(name):
    """With H = I no error can be folded anywhere useful: the same ints, scales and zero points as RTN."""
    scheme = scheme_by_name(name)
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(3))
    for got, want in zip(gptq_quantize(w, torch.eye(128), scheme), quantize_weight(w, scheme)):
        assert torch.equal(got, want)


def test_input_hessians_match_the_inputs_and_block_inputs_stop_before_the_block():
    model = _model().eval()
    seen, head_calls = [], []
    wq = model.layers["0"].attention.wq
    hook = wq.register_forward_pre_hook(lambda m, a: seen.append(a[0].reshape(-1, 64)))
    model.output.register_forward_pre_hook(lambda m, a: head_calls.append(1))
    batches = _batches(2)
    h = input_hessians({"wq": wq}, lambda: [model(b) for b in batches])
    hook.remove()
    x = torch.cat(seen)
    torch.testing.assert_close(h["wq"], x.T @ x / x.shape[0])
    head_calls.clear()
    kept = block_inputs(model, model.layers["0"], batches)
    assert len(kept) == 2 and not head_calls and kept[0][0][0].shape == (2, 16, 64)


def test_block_by_block_calibration_equals_rerunning_the_whole_model():
    """gptq_modules keeps each block's inputs instead of re-running the model: the same integers as a plain
    loop that, block after block, runs the whole (partly rounded) model to collect H."""
    scheme, batches = scheme_by_name("int4-g32"), _batches()
    model = _model()
    fast = gptq_modules(model, quant_targets(model), scheme, batches)
    slow_model = _model().eval()
    slow = {}
    for block in ("layers.0", "layers.1"):
        stage = {n: m for n, m in quant_targets(slow_model) if n.startswith(block + ".")}
        hessians = input_hessians(stage, lambda: [slow_model(b) for b in batches])
        for name, linear in stage.items():
            q, scales, zeros = gptq_quantize(linear.weight, hessians[name], scheme)
            with torch.no_grad():
                linear.weight.copy_(dequantize_weight(q, scales, zeros, scheme))
            slow[name] = q
    assert fast.keys() == slow.keys()
    for name, q in slow.items():
        packed = pack_int4(q.to(torch.int16) + 8)
        assert torch.equal(fast[name].weight_int4, packed), name


@pytest.mark.parametrize("name", ["int4-g32", "8da4w-g64", "int8"])
def test_ptq_gptq_beats_rtn_on_the_calibration_logits_in_the_same_format(name):
    batches = _batches()
    fp, rtn = _model(), ptq(_model(), name)
    gptq = ptq(_model(), name, method="gptq", calibration=batches)
    assert quant_meta(gptq) == {**quant_meta(rtn), "method": "gptq"}
    packed = Int8WeightLinear if name == "int8" else Int4WeightLinear
    assert isinstance(gptq.layers["1"].feed_forward.w2, packed)
    assert {k: (v.shape, v.dtype) for k, v in gptq.state_dict().items()} == \
        {k: (v.shape, v.dtype) for k, v in rtn.state_dict().items()}
    with torch.no_grad():
        ref = [fp(b) for b in batches]
        err = {m: sum(float(((model(b) - r) ** 2).sum()) for b, r in zip(batches, ref)) for m, model in
               (("rtn", rtn), ("gptq", gptq))}
    assert err["gptq"] < err["rtn"]


def test_gptq_checkpoint_loads_through_the_quantized_skeleton(tmp_path):
    model = ptq(_model(), "int4-g32", method="gptq", calibration=_batches(), embeddings=True)
    tokens = _batches(1, seed=7)[0]
    with torch.no_grad():
        ref = model(tokens)
    path = save_checkpoint(tmp_path, 1, model, None, {"quant": quant_meta(model)}, keep=1, writer=True)
    assert read_meta(path)["quant"]["method"] == "gptq"
    fresh = apply_checkpoint_quant(_model(seed=5), read_meta(path))
    load_checkpoint(path, fresh, None)
    with torch.no_grad():
        assert torch.equal(fresh(tokens), ref)


def test_gptq_leaves_the_calibrated_model_unchanged_outside_its_targets():
    model = _model()
    before = copy.deepcopy(model.output.weight)
    ptq(model, "int4-g32", method="gptq", calibration=_batches(2))
    assert torch.equal(model.output.weight, before) and type(model.output) is torch.nn.Linear


def test_gptq_without_calibration_or_unknown_method_is_a_config_error():
    with pytest.raises(ConfigError, match="calibration"):
        ptq(_model(), "int4-g32", method="gptq")
    with pytest.raises(ConfigError, match="gptq"):
        ptq(_model(), "int4-g32", method="awq")
