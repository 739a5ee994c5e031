"""The CPU step (fourfold.infer.cpu_decoder, cpu_attention): its attention equals the paged reference on mixed
steps, its logits equal the model's own paged forward, and engines running it equal Hugging Face greedy (float32)
and the model's own forward (bf16, packed) token for token."""

import copy

import pytest
import torch

from fourfold.infer.cpu_attention import CpuStepAttention
from fourfold.infer.cpu_decoder import CpuDecoder, RowsOf
from fourfold.infer.cpu_linear import pack_cpu_linears, packing_works
from fourfold.infer.engine import LLMEngine
from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.kv_pool import KVPool
from fourfold.infer.model_runner import ModelRunner
from fourfold.infer.paged_attention import paged_attention_reference
from fourfold.infer.sequence import Sequence
from fourfold.infer.step_tensors import StepTensors
from fourfold.tokenizer import ByteTokenizer
from tests.engine_helpers import GREEDY, run_to_end, tiny_model
from tests.test_engine_attention import D, scattered_sequences
from tests.test_engine_fused import PROMPTS, _step
from tests.test_model import hugging_face_twin

CASES = {  # (tokens cached after the step, tokens this step) per sequence
    "mixed": ([9, 6, 6, 1, 13, 4, 6], [1, 6, 6, 1, 5, 1, 6]),  # decodes between fresh prompts and a later chunk
    "decodes": ([9, 1, 13], [1, 1, 1]),
    "fresh": ([5, 5, 5], [5, 5, 5]),
}


@pytest.mark.parametrize("case", CASES)
def test_step_attention_equals_the_reference(case):
    lengths, new = CASES[case]
    q, kc, vc, tables, lens, starts, dense = scattered_sequences(lengths, new)
    k = torch.cat([kd[-n:] for (kd, _), n in zip(dense, new)])  # this step's keys and values, already in the pool
    v = torch.cat([vd[-n:] for (_, vd), n in zip(dense, new)])
    st = StepTensors(torch.zeros(len(q), dtype=torch.long), torch.zeros(len(q), dtype=torch.long),
                     torch.zeros(len(q), dtype=torch.long), tables, lens, starts, torch.zeros(0, dtype=torch.long))
    want = paged_attention_reference(q, kc, vc, tables, lens, starts, D ** -0.5)
    got = CpuStepAttention(st, kc.shape[1]).attend(q, k, v, kc, vc, D ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _runner(model, fuse):
    cfg = model.cfg
    pool = KVPool(cfg.n_layers, 64, 4, cfg.n_kv_heads, cfg.head_dim, torch.float64, torch.device("cpu"))
    return ModelRunner(model, pool, torch.device("cpu"), fuse=fuse)


def _decoder_runner(model):
    runner = _runner(model, None)
    assert runner.cpu_decoder is not None and runner.fused is None
    return runner


def test_cpu_step_logits_equal_the_model_forward():
    model = tiny_model()
    plain, ours = _runner(model, False), _decoder_runner(copy.deepcopy(model))
    assert plain.cpu_decoder is None
    prompts = PROMPTS + [[9, 8, 7, 6, 5], [4, 3, 2, 1, 0]]  # two fresh prompts of one length run batched
    seqs = {r: [Sequence(str(i), p, GREEDY, i) for i, p in enumerate(prompts)] for r in ("plain", "ours")}
    first = [len(p) for p in prompts]
    first[1] = 4  # the 11-token prompt comes in two chunks: the second attends to cached keys
    for sizes in (first, [1, 7, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]):
        want = _step(plain, seqs["plain"], sizes)
        got = _step(ours, seqs["ours"], sizes)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        for r in seqs.values():  # the next decode token of every sequence
            for s in r:
                if s.num_computed >= len(s.prompt_ids):
                    s.output_ids.append(5)
    torch.testing.assert_close(ours.pool.keys, plain.pool.keys, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours.pool.values, plain.pool.values, rtol=1e-10, atol=1e-10)


def test_fused_weights_are_shared_with_the_model():
    model = tiny_model()
    tokens = torch.tensor([PROMPTS[1]])
    want = model(tokens)
    decoder = CpuDecoder.from_model(model)
    att = model.layers["0"].attention
    assert att.wk.weight.untyped_storage().data_ptr() == att.wq.weight.untyped_storage().data_ptr()
    torch.testing.assert_close(model(tokens), want, rtol=0, atol=0)  # the model's own forward still runs
    assert decoder is not None
    stage = tiny_model()
    stage.tok_embeddings = None  # a pipeline stage runs the model's forward
    assert CpuDecoder.from_model(stage) is None


def _bf16_model():
    model = tiny_model(init_std=0.1).to(torch.bfloat16)
    model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()
    return model


@pytest.mark.skipif(not packing_works(), reason="this torch build has no oneDNN bf16 linear")
def test_packed_bf16_engine_generates_what_the_model_forward_does():
    plain = _bf16_model()
    packed, reference = copy.deepcopy(plain), copy.deepcopy(plain)
    pack_cpu_linears(packed)
    pack_cpu_linears(reference)
    prompts = {"a": ([3, 14, 15, 9, 26], GREEDY), "b": ([1, 2, 3, 4, 5, 6, 7, 8], GREEDY), "c": ([7], GREEDY)}
    cfg = dict(block_size=4, num_kv_blocks=32)
    want, _ = run_to_end(LLMEngine.from_model(reference, ByteTokenizer(), EngineConfig(fused_decoder=False, **cfg)),
                         prompts)
    engine = LLMEngine.from_model(packed, ByteTokenizer(), EngineConfig(**cfg))
    assert engine.runner.cpu_decoder is not None
    assert isinstance(packed.layers["0"].attention.wq, RowsOf)  # q|k|v packed once, the model slices it
    got, _ = run_to_end(engine, prompts)
    assert got == want
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(packed.layers["0"].attention.wk(x).float(),
                               reference.layers["0"].attention.wk(x).float(), rtol=1e-2, atol=1e-2)


def test_float32_engine_equals_hugging_face_greedy():
    model = tiny_model().float()
    hf = hugging_face_twin(model)
    engine = LLMEngine.from_model(model, ByteTokenizer(), EngineConfig(block_size=4, num_kv_blocks=64,
                                                                        max_num_batched_tokens=8))
    assert engine.runner.cpu_decoder is not None
    prompts = {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)}
    got, _ = run_to_end(engine, prompts)  # a budget of 8 tokens: chunked prefill beside running decodes
    for i, p in enumerate(PROMPTS):
        out = hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        assert got[str(i)] == out[0, len(p):].tolist()


def test_chunks_of_a_step_are_planned_by_kind():
    lengths, new = CASES["mixed"]
    _, kc, _, tables, lens, starts, _ = scattered_sequences(lengths, new)
    st = StepTensors(*(torch.zeros(1, dtype=torch.long),) * 3, tables, lens, starts, torch.zeros(0, dtype=torch.long))
    plan = CpuStepAttention(st, kc.shape[1])
    assert plan.decode[3] == 3  # three decodes in one SDPA
    assert plan.fresh == [(1, 2, 6), (20, 1, 6)]  # the two adjacent 6-token prompts batched, not the third
    assert [(a, b) for a, b, _, _ in plan.continuing] == [(14, 19)]


def test_a_lone_decode_over_consecutive_blocks_reads_the_pool_in_place():
    torch.manual_seed(1)
    kc, vc = torch.randn(8, 4, 2, D, dtype=torch.float64), torch.randn(8, 4, 2, D, dtype=torch.float64)
    q = torch.randn(1, 4, D, dtype=torch.float64)
    lens, starts = torch.tensor([10], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    for table, in_place in (([3, 4, 5, 0], True), ([3, 5, 4, 0], False)):
        tables = torch.tensor([table], dtype=torch.int32)
        st = StepTensors(*(torch.zeros(1, dtype=torch.long),) * 3, tables, lens, starts, torch.zeros(0, dtype=torch.long))
        plan = CpuStepAttention(st, 4)
        assert (plan.single is not None) == in_place
        want = paged_attention_reference(q, kc, vc, tables, lens, starts, D ** -0.5)
        got = plan.attend(q, q[:, :2], q[:, :2], kc, vc, D ** -0.5)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
