"""An int4 linear that keeps only int4_mma's words (fourfold.quant.one_copy): same outputs, checkpoints still in
the stored layout, fused q|k|v and gate|up as views of stacked words, and the all-or-none rule over the blocks.

On CPU the words layout is exercised through the modules' own paths (torch's CPU kernel on nibbles made from the
words) and int4_gemm under TRITON_INTERPRET; the engine test at the end needs CUDA and cuda-bindings."""

import copy

import pytest
import torch

from fourfold.config import build_config
from fourfold.infer import fused_decoder
from fourfold.models.llama import Llama
from fourfold.ops import nvrtc_launch
from fourfold.quant import one_copy
from fourfold.quant.packing import Int4WeightLinear
from fourfold.quant.qat import ptq
from fourfold.quant.schemes import scheme_by_name


def _linears(rows=(64, 32, 32), k=128, scheme="int4-g64-asym", seed=0) -> list[Int4WeightLinear]:
    torch.manual_seed(seed)
    return [Int4WeightLinear.from_float(torch.nn.Linear(k, n, bias=False), scheme_by_name(scheme)) for n in rows]


def test_words_give_the_same_outputs_and_state_dict():
    mods = _linears()
    x = torch.randn(3, 128)
    want = [m(x) for m in mods]
    stored = [m.state_dict()["weight_int4"].clone() for m in mods]
    for m in mods:
        m.to_words()
        assert m.holds_words and m.weight_int4.dtype == torch.int32 and m.weight_int4.shape == (m.out_features // 16, 256)
    for m, y, s in zip(mods, want, stored):
        assert torch.equal(m(x), y)
        assert m.state_dict()["weight_int4"].dtype == torch.uint8
        assert torch.equal(m.state_dict()["weight_int4"], s)       # checkpoints keep the stored layout
    fresh = Int4WeightLinear(128, 64, False, scheme_by_name("int4-g64-asym"))
    fresh.to_words()
    fresh.load_state_dict({"weight_int4": stored[0], "scales": mods[0].scales, "zero_points": mods[0].zero_points})
    assert fresh.holds_words and torch.equal(fresh.weight_int4, mods[0].weight_int4) and torch.equal(fresh(x), want[0])
    mods[1].to_stored()
    assert not mods[1].holds_words and torch.equal(mods[1].weight_int4, stored[1])


def test_words_modules_fuse_into_views_of_stacked_words(monkeypatch):
    monkeypatch.setattr(Int4WeightLinear, "words_fit", lambda self, device: True)
    mods = _linears()
    x = torch.randn(2, 128)
    want = torch.cat([m(x) for m in mods], dim=-1)
    stored = [m.state_dict()["weight_int4"].clone() for m in mods]
    for m in mods:
        m.to_words()
    fused = fused_decoder._fuse_int4(mods)
    assert fused.holds_words and fused.weight_int4.shape == (8, 256)
    base = fused.weight_int4.untyped_storage().data_ptr()
    for i, m in enumerate(mods):
        assert m.weight_int4.untyped_storage().data_ptr() == base      # views: no second copy
        assert torch.equal(m.state_dict()["weight_int4"], stored[i])
    assert torch.equal(fused(x), want)


def test_stacked_words_that_do_not_fit_go_back_to_stored_nibbles(monkeypatch):
    monkeypatch.setattr(Int4WeightLinear, "words_fit", lambda self, device: self.out_features <= 96)
    mods = _linears()
    x = torch.randn(2, 128)
    want = torch.cat([m(x) for m in mods], dim=-1)
    for m in mods:
        m.to_words()
    fused = fused_decoder._fuse_int4(mods)          # 128 stacked rows: over this test's limit
    assert not fused.holds_words and not any(m.holds_words for m in mods)
    assert torch.equal(fused(x), want)


def _model(**overrides) -> Llama:
    fields = dict(dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=256, vocab_size=96, max_seq_len=320)
    cfg = build_config({"model": {**fields, **overrides}, "train": {"seq_len": 32}}).model
    torch.manual_seed(0)
    return Llama(cfg).eval()


def test_keep_one_copy_takes_every_block_linear_or_none(monkeypatch):
    model = _model()
    ptq(model, "int4-g64", output=True)
    int4 = {name: m for name, m in model.named_modules() if isinstance(m, Int4WeightLinear)}
    monkeypatch.setattr(one_copy, "ENABLED", True)
    assert one_copy.keep_one_copy(model, torch.device("cpu")) == 0      # off CUDA: nothing
    monkeypatch.setattr(Int4WeightLinear, "words_fit", lambda self, device: self.out_features != 256)
    assert one_copy.keep_one_copy(model, torch.device("cuda")) == 1      # a w1/w3 does not fit: only the head
    assert [n for n, m in int4.items() if m.holds_words] == ["output"]
    monkeypatch.setattr(Int4WeightLinear, "words_fit", lambda self, device: True)
    monkeypatch.setattr(one_copy, "ENABLED", False)
    assert one_copy.keep_one_copy(model, torch.device("cuda")) == 0
    monkeypatch.setattr(one_copy, "ENABLED", True)
    assert one_copy.keep_one_copy(model, torch.device("cuda")) == len(int4)
    assert all(m.holds_words for m in int4.values())


def test_a_words_module_without_a_tensor_core_path_refuses_decode():
    mod = _linears(rows=(32,))[0]
    mod.to_words()
    assert not mod.uses_gemv(torch.randn(1, 128))
    with pytest.raises(ValueError, match="tensor-core"):
        mod.decode(torch.randn(1, 128))


@pytest.mark.skipif(not (torch.cuda.is_available() and nvrtc_launch.available()), reason="needs CUDA + cuda-bindings")
def test_engine_with_one_copy_matches_three_copies_on_gpu(monkeypatch):
    """Greedy tokens at 1 and 4 sequences (decode GEMVs), a 100-token prompt (the W4A16 GEMM on words) and a
    200-token one (dequantize + cuBLAS) equal those of the engine that keeps the stored nibbles and the planes."""
    from fourfold.infer.engine import LLMEngine
    from fourfold.infer.engine_config import EngineConfig
    from fourfold.infer.requests import SamplingParams
    from fourfold.tokenizer import ByteTokenizer
    from tests.engine_helpers import run_to_end

    model = _model(vocab_size=320, init_std=0.1).to("cuda", torch.bfloat16)
    ptq(model, "int4-g64")
    gen = torch.Generator().manual_seed(1)
    prompts = {f"p{n}-{i}": torch.randint(0, 320, (n,), generator=gen).tolist()
               for n, count in ((5, 1), (9, 4), (100, 1), (200, 1)) for i in range(count)}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for enabled in (False, True):
        monkeypatch.setattr(one_copy, "ENABLED", enabled)
        m = copy.deepcopy(model)
        engine = LLMEngine.from_model(m, ByteTokenizer(), EngineConfig(block_size=16, num_kv_blocks=128),
                                      torch.device("cuda"))
        blocks = [mod for name, mod in m.named_modules() if isinstance(mod, Int4WeightLinear) and "layers" in name]
        assert all(mod.holds_words == enabled for mod in blocks)
        for rid, prompt in prompts.items():   # one at a time, then the four short ones together
            if not rid.startswith("p9"):
                tokens[enabled, rid] = run_to_end(engine, {rid: (prompt, params)})[0][rid]
        together, _ = run_to_end(engine, {rid: (p, params) for rid, p in prompts.items() if rid.startswith("p9")})
        tokens.update({(enabled, rid): t for rid, t in together.items()})
        if enabled:
            assert all(not mod._planes_cache for mod in blocks)
            assert torch.equal(m.state_dict()["layers.0.feed_forward.w1.weight_int4"],
                               model.state_dict()["layers.0.feed_forward.w1.weight_int4"])
    for rid in prompts:
        assert tokens[True, rid] == tokens[False, rid], rid
