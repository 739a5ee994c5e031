"""The fused inference forward (fourfold.infer.fused_decoder, torch fallback of its kernels on CPU) gives the
model's own paged forward's logits, and an engine running it equals Hugging Face greedy token for token."""

import copy

import torch

from fourfold.infer.cpu_linear import pack_cpu_linears
from fourfold.infer.engine import LLMEngine
from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.fused_decoder import FusedDecoder, can_fuse
from fourfold.infer.fused_ops import add_rms_norm, silu_mul
from fourfold.infer.kv_pool import KVPool
from fourfold.infer.model_runner import ModelRunner
from fourfold.infer.scheduler import ScheduledChunk
from fourfold.infer.sequence import Sequence
from fourfold.infer.requests import SamplingParams
from fourfold.models.llama import RMSNorm
from fourfold.tokenizer import ByteTokenizer
from tests.engine_helpers import GREEDY, Twin, run_to_end, tiny_model

PROMPTS = [[3, 14, 15, 9, 26], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7], [40, 41, 42, 43, 44, 45, 46, 47]]


def _runner(model, fuse: bool) -> ModelRunner:
    cfg = model.cfg
    pool = KVPool(cfg.n_layers, 32, 4, cfg.n_kv_heads, cfg.head_dim, torch.float64, torch.device("cpu"))
    return ModelRunner(model, pool, torch.device("cpu"), fuse=fuse)


def _step(runner: ModelRunner, seqs: list[Sequence], sizes: list[int]):
    for seq, n in zip(seqs, sizes):  # give each sequence the blocks its next n tokens need
        while len(seq.block_table) * runner.pool.block_size < seq.num_computed + n:
            seq.block_table.append(len(seq.block_table) + 8 * int(seq.request_id))
    chunks = [ScheduledChunk(seq, n, True) for seq, n in zip(seqs, sizes)]
    logits = runner.forward(runner.prepare(chunks))
    for seq, n in zip(seqs, sizes):
        seq.num_computed += n
    return logits


def _steps_match(plain: ModelRunner, fused: ModelRunner, step_sizes: list[list[int]], tol: float) -> None:
    """Run the first three PROMPTS through both runners step by step (tokens per sequence in each step, then one
    decode token 5 appended to every sequence); each step's logits of `fused` equal `plain`'s within tol."""
    seqs = {r: [Sequence(str(i), p, GREEDY, i) for i, p in enumerate(PROMPTS[:3])] for r in ("plain", "fused")}
    for sizes in step_sizes:
        want = _step(plain, seqs["plain"], sizes)
        got = _step(fused, seqs["fused"], sizes)
        assert got.shape == want.shape == (3, plain.model.cfg.vocab_size)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        for r in seqs.values():  # the next decode token of every sequence
            for s in r:
                s.output_ids.append(5)


def test_fused_step_logits_equal_the_model_forward():
    model = tiny_model()
    fused_model = copy.deepcopy(model)
    plain, fused = _runner(model, False), _runner(fused_model, True)
    assert plain.fused is None and fused.fused is not None
    _steps_match(plain, fused, [[len(p) for p in PROMPTS[:3]], [1, 1, 1]], 1e-10)
    torch.testing.assert_close(fused.pool.keys, plain.pool.keys, rtol=1e-10, atol=1e-10)


def test_fusing_keeps_the_model_weights_as_views():
    model = tiny_model()
    want = model(torch.tensor([PROMPTS[1]]))
    decoder = FusedDecoder.from_model(model)
    att = model.layers["0"].attention
    block = decoder.blocks[0][1]
    assert att.wk.weight.data_ptr() == block.qkv.weight[att.wq.weight.shape[0]:].data_ptr()
    torch.testing.assert_close(model(torch.tensor([PROMPTS[1]])), want, rtol=0, atol=0)
    packed = tiny_model().to(torch.bfloat16)
    pack_cpu_linears(packed)  # packed oneDNN linears are not plain nn.Linear: left alone
    assert not can_fuse(packed)
    model.tok_embeddings = None
    assert not can_fuse(model)


def test_add_rms_norm_and_silu_mul_match_the_model_ops():
    torch.manual_seed(0)
    x, r = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(3, 16, dtype=torch.bfloat16)
    norm = RMSNorm(16).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_()
    out, summed = add_rms_norm(x, r, norm.weight, norm.eps)
    assert torch.equal(summed, x + r) and torch.equal(out, norm(x + r))
    gu = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(silu_mul(gu), torch.nn.functional.silu(gu[:, :4]) * gu[:, 4:])


def test_engine_with_the_fused_decoder_equals_hugging_face():
    twin = Twin()
    engine = LLMEngine(_runner(twin.model, True), ByteTokenizer(), EngineConfig(block_size=4, max_num_batched_tokens=7),
                       64)
    got, _ = run_to_end(engine, {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)})
    for i, p in enumerate(PROMPTS):
        assert got[str(i)] == twin.hf_greedy(p, GREEDY.max_tokens), f"prompt {i}"


def test_overlapped_steps_give_the_same_tokens_and_stops():
    """With `overlap` (the CUDA default, forced here) outputs come a step late but tokens and stops are the same."""
    twin = Twin()
    requests = {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)}
    requests["eos"] = (PROMPTS[0], SamplingParams(max_tokens=10, temperature=0.0))
    requests["seeded"] = (PROMPTS[2], SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True))
    sync = twin.engine(max_num_batched_tokens=7)
    want, _ = run_to_end(sync, requests)
    eos = want["eos"][3]  # make a token the sequence emits its end of sequence
    sync2, lagged = twin.engine(max_num_batched_tokens=7), twin.engine(max_num_batched_tokens=7)
    sync2.eos_id = lagged.eos_id = eos
    lagged.overlap = True
    want, want_steps = run_to_end(sync2, requests)
    got, got_steps = run_to_end(lagged, requests)
    assert got == want and len(got["eos"]) < 10 and lagged.look_aheads > 5
    finished = lambda steps: sorted((o.request_id, o.finish_reason) for s in steps for o in s if o.finished)
    assert finished(got_steps) == finished(want_steps)
    assert want_steps[0] and not got_steps[0]  # the first step's tokens come with the second step
    assert lagged.blocks.num_used == sync2.blocks.num_used
    assert set(lagged.blocks.hash_to_block) <= set(sync2.blocks.hash_to_block)  # no placeholder was hashed


def test_an_eager_step_uploads_every_input_16_byte_aligned():
    # model_runner.aligned_views lays a CUDA eager step's inputs out as the captured graphs' are: each view starts on
    # a 16-byte boundary, whatever the step's sizes, and holds its part's values.
    import numpy as np

    from fourfold.infer.model_runner import aligned_views

    for dtype in (np.int64, np.int32):
        for sizes in ([3, 3, 3, 1], [5, 1, 7], [(3, 5), 3, 4]):
            parts = [np.arange(np.prod(n), dtype=dtype).reshape(n) + 100 * i for i, n in enumerate(sizes)]
            views, data = aligned_views(parts, dtype, torch.from_numpy)
            for p, v in zip(parts, views):
                assert v.shape == p.shape and torch.equal(v, torch.from_numpy(p))
                assert (v.data_ptr() - data.data_ptr()) % 16 == 0
