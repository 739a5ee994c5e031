"""prepare_qat / convert / ptq / quantized_skeleton (fourfold.quant.qat): which layers, same function, checks before work."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from torch import nn

from fourfold.checkpoint.store import load_checkpoint, read_meta, save_checkpoint
from fourfold.config import QUANT_SCHEMES, ModelConfig, build_config
from fourfold.errors import ConfigError
from fourfold.models.llama import Llama
from fourfold.quant.embedding import FakeQuantEmbedding, QuantEmbedding
from fourfold.quant.fake_quant import FakeQuantLinear, fake_quantize_weight
from fourfold.quant.packing import Int4WeightLinear, Int8WeightLinear
from fourfold.quant.qat import (apply_checkpoint_quant, check_device_runs, check_scheme_fits, convert, prepare_qat,
                                ptq, quant_meta, quantized_skeleton)
from fourfold.quant.schemes import PRESETS, scheme_by_name

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=320, max_seq_len=32)
BLOCK_LINEARS = 2 * 7


def _model(seed: int = 0, cfg: ModelConfig = CFG) -> Llama:
    model = Llama(cfg)
    model.init_weights(seed)
    return model


def _tokens():
    return torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))


def test_config_scheme_names_are_the_presets():
    assert set(QUANT_SCHEMES) == set(PRESETS)


def test_prepare_qat_swaps_block_linears_only_and_keeps_parameters():
    model = _model()
    params = dict(model.named_parameters())
    prepare_qat(model, "int4-g32")
    fakes = [n for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)]
    assert len(fakes) == BLOCK_LINEARS and all(n.startswith("layers.") for n in fakes)
    assert type(model.output) is nn.Linear and type(model.tok_embeddings) is nn.Embedding
    after = dict(model.named_parameters())
    assert after.keys() == params.keys() and all(after[k] is params[k] for k in params)


def test_embeddings_and_output_are_opt_in():
    model = prepare_qat(_model(), "int8", embeddings=True, output=True)
    assert isinstance(model.output, FakeQuantLinear) and isinstance(model.tok_embeddings, FakeQuantEmbedding)


def test_qat_forward_uses_fake_quantized_weights():
    model, plain = prepare_qat(_model(), "int4-g64"), _model()
    with torch.no_grad():
        for (name, fq), (_, lin) in zip(model.named_modules(), plain.named_modules()):
            if isinstance(fq, FakeQuantLinear):
                lin.weight.copy_(fake_quantize_weight(lin.weight, fq.scheme))
        assert torch.equal(model(_tokens()), plain(_tokens()))
        assert not torch.equal(model(_tokens()), _model()(_tokens()))


# fp32: the CPU int4/int8 kernels accumulate in a different order than F.linear (relative 1e-5 of max |logit|).
@pytest.mark.parametrize("name,embeddings,output", [("int4-g32", False, False), ("int4-g64-asym", True, True),
                                                    ("8da4w-g32", False, True), ("int8", True, True),
                                                    ("int4-g32-fp32", True, False)])
def test_converted_model_computes_the_fake_quant_function(name, embeddings, output):
    model = prepare_qat(_model(), name, embeddings=embeddings, output=output)
    with torch.no_grad():
        ref = model(_tokens())
        convert(model)
        got = model(_tokens())
    packed = Int4WeightLinear if PRESETS[name].weight_bits == 4 else Int8WeightLinear
    assert sum(isinstance(m, packed) for m in model.modules()) == BLOCK_LINEARS + output
    assert isinstance(model.tok_embeddings, QuantEmbedding) == embeddings
    assert not any(isinstance(m, FakeQuantLinear) for m in model.modules())
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_ptq_is_round_to_nearest_of_the_trained_weights():
    model = _model()
    with torch.no_grad():
        ref = prepare_qat(_model(), "int4-g32")(_tokens())
        got = ptq(model, "int4-g32")(_tokens())
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert quant_meta(model) == {"scheme": "int4-g32", "embeddings": False, "output": False, "method": "rtn",
                                 "format": "fourfold-packed-v1"}


def test_converted_checkpoint_round_trips_through_quantized_skeleton(tmp_path):
    model = ptq(_model(), "int4-g32", embeddings=True)
    with torch.no_grad():
        ref = model(_tokens())
    meta = {"quant": quant_meta(model)}
    path = save_checkpoint(tmp_path, 3, model, None, meta, keep=1, writer=True)
    assert read_meta(path)["quant"]["scheme"] == "int4-g32"
    stored = {}  # tensor name -> dtype, over every shard file (keys are name@offsets)
    for shard in path.glob("model-*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            stored.update({k.split("@")[0]: f.get_tensor(k).dtype for k in f.keys()})
    assert stored["layers.0.attention.wq.weight_int4"] == torch.uint8
    assert stored["layers.0.attention.wq.scales"] == torch.bfloat16
    assert "layers.0.attention.wq.weight" not in stored
    fresh = apply_checkpoint_quant(_model(seed=5), read_meta(path))
    load_checkpoint(path, fresh, None)
    with torch.no_grad():
        assert torch.equal(fresh(_tokens()), ref)


def test_quantized_skeleton_has_the_converted_state_dict_shapes():
    converted = ptq(_model(), "8da4w-g64", output=True)
    skeleton = quantized_skeleton(_model(), quant_meta(converted))
    want = {k: (v.shape, v.dtype) for k, v in converted.state_dict().items()}
    assert {k: (v.shape, v.dtype) for k, v in skeleton.state_dict().items()} == want


def test_bad_schemes_are_refused_before_any_layer_changes():
    with pytest.raises(ConfigError, match="Unknown quantization scheme 'int4-g100'"):
        prepare_qat(_model(), "int4-g100")
    model = _model()
    with pytest.raises(ConfigError, match="input features, which group size 128"):
        prepare_qat(model, "int4-g128")            # dim 64
    assert not any(isinstance(m, FakeQuantLinear) for m in model.modules())
    with pytest.raises(ConfigError, match="straddle"):
        check_scheme_fits(_model(), scheme_by_name("int4-g64"), tp=2)     # wo shards of 32 input features
    check_scheme_fits(_model(), scheme_by_name("int4-g32"), tp=2)
    odd = _model(cfg=ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=300))
    with pytest.raises(ConfigError, match="multiple of 16"):
        ptq(odd, "int4-g32", output=True)                                    # vocab 300 head
    assert isinstance(odd.layers["0"].attention.wq, nn.Linear) and type(odd.layers["0"].attention.wq) is nn.Linear


def test_devices_that_cannot_run_a_scheme_are_refused(monkeypatch):
    check_device_runs(scheme_by_name("int4-g32"), torch.device("cpu"))
    with pytest.raises(ConfigError, match="run on CPU or CUDA"):
        check_device_runs(scheme_by_name("int4-g32"), torch.device("meta"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ConfigError, match="compute capability 8.0"):
        check_device_runs(scheme_by_name("int4-g32"), torch.device("cuda"))


def test_config_qat_key_is_checked():
    assert build_config({}, {"quant.qat": "8da4w-g32"}).quant.qat == "8da4w-g32"
    with pytest.raises(ConfigError, match="quant.qat"):
        build_config({}, {"quant.qat": "int4-g31"})
    with pytest.raises(ConfigError, match="pick one"):
        build_config({}, {"quant.qat": "int8", "quant.float8": "true", "compute.precision": "bf16"})
