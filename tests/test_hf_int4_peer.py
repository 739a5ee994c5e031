"""bench/hf_int4.py, the int4 peer of bench/generate.py: torch's int4 kernel computes the RTN-dequantized Llama."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

SPEC = importlib.util.spec_from_file_location("hf_int4", Path(__file__).resolve().parents[1] / "bench" / "hf_int4.py")
hf_int4 = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(hf_int4)


def tiny_llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def test_rtn_round_trip_is_within_half_a_step():
    w = torch.randn(32, 128)
    u, scales = hf_int4.quantize_rtn(w, 32)
    assert u.dtype == torch.uint8 and int(u.max()) <= 15
    err = (hf_int4.dequantize(u, scales, 32) - w).abs().reshape(32, 4, 32)
    assert bool((err <= scales[..., None] / 2 + 1e-6).all())


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_llama_matches_its_dequantized_weights(group):
    model = tiny_llama()
    reference = copy.deepcopy(model)
    for layer in reference.model.layers:
        for mod in layer.modules():
            if isinstance(mod, torch.nn.Linear):
                u, scales = hf_int4.quantize_rtn(mod.weight, group)
                mod.weight.data = hf_int4.dequantize(u, scales, group).to(torch.bfloat16)
    unquantized = copy.deepcopy(model)
    assert hf_int4.quantize_decoder_linears(model, group) == 2 * 7
    assert isinstance(model.model.layers[0].mlp.down_proj, hf_int4.TorchInt4Linear)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want, plain = (m(ids).logits.float() for m in (model, reference, unquantized))
    assert (got - want).abs().max() < 0.03
    assert (plain - want).abs().max() > 0.1   # the quantization is visible, so the check above means something


def test_a_group_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="divisible by 256"):
        hf_int4.TorchInt4Linear(torch.nn.Linear(128, 32, bias=False), 256)


def test_the_self_check_catches_a_wrong_scale_layout():
    linear = torch.nn.Linear(128, 32, bias=False).to(torch.bfloat16)
    module = hf_int4.TorchInt4Linear(linear, 32)
    hf_int4.check_against_dequantized(module, linear.weight)   # as built: passes
    module.scales_and_zeros = module.scales_and_zeros.flip(0).contiguous()   # groups' scales in the wrong order
    with pytest.raises(RuntimeError, match="disagrees"):
        hf_int4.check_against_dequantized(module, linear.weight)
