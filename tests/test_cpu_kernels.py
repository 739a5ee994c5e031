"""The fused CPU kernels (fourfold.infer.cpu_kernels): each equals the torch ops it replaces (float32 to rounding,
bf16 within a stated tolerance), the engine's greedy tokens are the same with and without them and equal Hugging
Face's in float32, and the loader caches its build and falls back when turned off or when the compiler fails.
Skipped only where no C compiler exists (CI installs gcc, so there they run)."""

import copy
import ctypes

import pytest
import torch

from fourfold.infer import cpu_kernels
from fourfold.infer.cpu_linear import pack_cpu_linears, packing_works
from fourfold.infer.engine import LLMEngine
from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.paged_attention import paged_attention_reference
from fourfold.testing.cpu_kernel_cases import FUSED, REFERENCE, kernel_case
from fourfold.tokenizer import ByteTokenizer
from tests.engine_helpers import GREEDY, run_to_end, tiny_model
from tests.test_engine_fused import PROMPTS
from tests.test_model import hugging_face_twin

pytestmark = pytest.mark.skipif(cpu_kernels.compiler() is None, reason="no C compiler on this machine")

SMALL = dict(dim=48, hq=4, hkv=2, d=32, ffn=80, block_size=4)
MIXED = dict(lengths=[9, 20, 5, 33, 1], new=[9, 1, 5, 4, 1])  # a fresh prompt, decodes, a later chunk
BF16_TOL = {"add_rms_norm": 8e-3, "rope_write_kv": 8e-3, "silu_mul": 8e-3, "attention": 3e-2}
"""Relative tolerance in bf16: one bf16 rounding (2^-7) for the elementwise kernels; attention a few (torch's
CPU flash SDPA rounds its probabilities to bf16 before the value product, the kernel keeps them float32)."""


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels.load()
    assert k is not None, "a C compiler exists but the kernels did not build"
    return k


CASES = [("add_rms_norm", dict(tokens=3)), ("silu_mul", dict(tokens=3, ffn=300)),
         ("rope_write_kv", dict(tokens=4)), ("rope_write_kv", MIXED), ("attention", dict(tokens=5)),
         ("attention", MIXED), ("attention", dict(MIXED, hq=4, hkv=1)), ("attention", dict(MIXED, hq=3, hkv=3)),
         ("attention", dict(MIXED, d=16)), ("attention", dict(tokens=2, d=64, block_size=16)),
         ("attention", dict(MIXED, d=64, hq=6, hkv=2)), ("attention", dict(MIXED, d=64, hq=8, hkv=2)),
         ("attention", dict(MIXED, d=64, hq=10, hkv=2))]  # head size 64: AVX512-BF16 path for 1-4 heads a group


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,args", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_kernel_equals_the_torch_ops(kernels, kind, args, dtype):
    case = kernel_case(kind, dtype=dtype, seed=3, **{**SMALL, **args})
    want, got = REFERENCE[kind](case), FUSED[kind](kernels, case)
    tol = 2e-6 if dtype == torch.float32 else BF16_TOL[kind]
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol)


def test_bf16_elementwise_kernels_round_where_torch_rounds(kernels):
    """Same roundings as the torch ops: bf16 add+norm, rotary and SiLU*up agree bit for bit on almost every element."""
    for kind in ("add_rms_norm", "rope_write_kv", "silu_mul"):
        case = kernel_case(kind, tokens=8, dtype=torch.bfloat16, seed=5, **SMALL)
        for w, g in zip(REFERENCE[kind](case), FUSED[kind](kernels, case)):
            assert (w == g).float().mean() > 0.99, kind


def test_attention_equals_the_float64_reference(kernels):
    case = kernel_case("attention", dtype=torch.float32, seed=1, **{**SMALL, **MIXED})
    st = case["st"]
    (got,) = FUSED["attention"](kernels, case)
    want = paged_attention_reference(case["q"].double(), case["k_cache"].double(), case["v_cache"].double(),
                                     st.block_tables, st.seq_lens, st.query_start, case["scale"])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _bf16_model():
    model = tiny_model(init_std=0.1).to(torch.bfloat16)
    model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    return model


def _engine(model, kernels_on: bool, **cfg) -> LLMEngine:
    engine = LLMEngine.from_model(model, ByteTokenizer(), EngineConfig(block_size=4, num_kv_blocks=64, **cfg))
    decoder = engine.runner.cpu_decoder
    assert decoder is not None and decoder.kernels is not None
    if not kernels_on:
        decoder.kernels = None
    return engine


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_bf16_engine_same_tokens_with_and_without_kernels(packed):
    if packed and not packing_works():
        pytest.skip("this torch build has no oneDNN bf16 linear")
    base = _bf16_model()
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    if packed:
        for m in models:
            pack_cpu_linears(m)
    prompts = {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)}
    want, _ = run_to_end(_engine(models[0], False, max_num_batched_tokens=8), prompts)
    got, _ = run_to_end(_engine(models[1], True, max_num_batched_tokens=8), prompts)
    assert got == want


def test_float32_engine_with_kernels_equals_hugging_face_greedy():
    model = tiny_model().float()
    hf = hugging_face_twin(model)
    engine = _engine(model, True, max_num_batched_tokens=8)  # chunked prefill beside running decodes
    got, _ = run_to_end(engine, {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)})
    for i, p in enumerate(PROMPTS):
        out = hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        assert got[str(i)] == out[0, len(p):].tolist()


def test_float64_models_keep_the_torch_path():
    engine = LLMEngine.from_model(tiny_model(), ByteTokenizer(), EngineConfig(block_size=4, num_kv_blocks=16))
    decoder = engine.runner.cpu_decoder
    assert decoder.kernels is None  # not even built for a float64 model
    calls = []
    decoder._kernel_step = lambda *a: calls.append(a)
    run_to_end(engine, {"a": ([1, 2, 3], GREEDY)})
    assert not calls


def test_build_is_cached_and_keyed_by_source(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = tmp_path / "cpu_kernels.c"
    source.write_bytes(cpu_kernels.SOURCE.read_bytes())
    cc = cpu_kernels.compiler()
    first = cpu_kernels._compile(cc, source)
    assert first.parent == tmp_path / "fourfold" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels._compile(cc, source) == first and first.stat().st_mtime_ns == stamp  # cached, not rebuilt
    source.write_text(source.read_text() + "\n/* changed */\n")
    assert cpu_kernels._compile(cc, source) != first


def test_off_switch_and_broken_compiler_fall_back(tmp_path, monkeypatch):
    monkeypatch.setenv("FOURFOLD_CPU_KERNELS", "0")
    assert cpu_kernels.load.__wrapped__() is None
    monkeypatch.setenv("FOURFOLD_CPU_KERNELS", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert cpu_kernels.compiler().endswith("false")
    assert cpu_kernels.load.__wrapped__() is None
    monkeypatch.delenv("CC")
    assert cpu_kernels.load.__wrapped__() is not None


def test_build_without_openmp_threads_computes_the_same(tmp_path, monkeypatch):
    """Where torch brings no libgomp the kernels build with simd pragmas only (no second OpenMP runtime)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_gomp_loaded", lambda: False)
    k = cpu_kernels.Kernels(ctypes.CDLL(str(cpu_kernels._compile(cpu_kernels.compiler(), cpu_kernels.SOURCE))))
    assert k.lib.ff_max_threads() == 1
    for kind, args in (("attention", dict(MIXED, d=64, hq=6, hkv=2)), ("add_rms_norm", dict(tokens=40))):
        case = kernel_case(kind, dtype=torch.bfloat16, seed=2, **{**SMALL, **args})
        for w, g in zip(REFERENCE[kind](case), FUSED[kind](k, case)):
            torch.testing.assert_close(g.float(), w.float(), rtol=BF16_TOL[kind], atol=BF16_TOL[kind])
