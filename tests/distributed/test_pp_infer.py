"""Micro-batched pipeline-parallel inference (fourfold.infer.pipeline_engine) on pp=2 and pp=4 gloo ranks gives the
greedy tokens (and logprobs) of one process and of Hugging Face `generate`, for a ragged batch with chunked
prefill, requests that finish early, arrive late or are aborted while their step is in flight, and shares of
the KV pool small enough to force preemption; the stages really overlap (several micro-batch steps in flight
at once); the knob turns it back into the plain pipeline; `fourfold serve --pp 2`'s engine (rank 0 streams, rank 1 follows in lockstep) gives the tokens of one process."""

from __future__ import annotations

import pytest
import torch

from fourfold.config import build_config
from fourfold.infer.engine import LLMEngine
from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.requests import SamplingParams
from fourfold.models.llama import Llama
from fourfold.tokenizer import ByteTokenizer
from tests.distributed.launcher import run_ranks

ENGINE = dict(block_size=4, num_kv_blocks=96, max_num_batched_tokens=8)  # chunked prefill: prompts span steps
PROMPTS = [[5, 9, 2, 40], [7], list(range(3, 22)), [11, 12, 13, 14, 15, 16, 17], [60, 1, 33], list(range(40, 52))]
MAX_TOKENS = [9, 3, 6, 12, 1, 7]  # some finish after a token or three while others run on
LATE = {"late-0": ([8, 8, 9, 30, 31], 5), "late-1": (list(range(20, 33)), 8)}  # added after ARRIVE_AFTER steps
ARRIVE_AFTER, ABORT_AFTER = 4, 3


def _model() -> Llama:
    """A 4-layer float64 Llama (dim 32, vocab 64) with weights large enough that every context token matters."""
    torch.manual_seed(0)
    cfg = build_config({"model": dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                                      max_seq_len=64, init_std=0.4), "train": {"seq_len": 32}}).model
    return Llama(cfg).double().eval()


def _params(n: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=logprobs)


def _drive(engine) -> dict:
    """The scenario every engine runs: a ragged batch, two late arrivals, one abort; tokens and logprobs by id."""
    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        engine.add_request(f"r{i}", prompt, _params(n, logprobs=2 if i == 3 else None))
    engine.add_request("gone", list(range(1, 15)), _params(20))
    tokens, logprobs, steps = {}, {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            logprobs.setdefault(out.request_id, []).extend((lp.logprob, lp.top) for lp in out.logprobs)
        steps += 1
        if steps == ABORT_AFTER:
            engine.abort_request("gone")
        if steps == ARRIVE_AFTER:
            for rid, (prompt, n) in LATE.items():
                engine.add_request(rid, prompt, _params(n))
    tokens.pop("gone", None)
    stats = engine.stats()
    return {"tokens": tokens, "logprobs": logprobs, "steps": steps, "blocks_used": stats.kv_blocks_used,
            "preemptions": stats.preemptions}


def _pp_rank(rank: int, world_size: int, micro_batching: bool, overrides: dict | None = None) -> dict:
    import torch.distributed as dist

    from fourfold.infer.pipeline_engine import PipelineEngine, open_pipeline_engine
    from fourfold.parallel.pipeline.split import split_pipeline

    chunk = split_pipeline(_model(), rank, world_size)[0]
    cfg = EngineConfig(**{**ENGINE, **(overrides or {})}, pipeline_micro_batching=micro_batching)
    engine = open_pipeline_engine(chunk, ByteTokenizer(), cfg, torch.device("cpu"), None,
                                  stage_ranks=list(range(world_size)), group=dist.group.WORLD, sampling_seed=0)
    assert isinstance(engine, PipelineEngine) == micro_batching
    computed = []
    if micro_batching:  # count this stage's computed steps per tick
        plain_compute = engine._compute
        engine._compute = lambda key, step: (computed.append(engine.tick), plain_compute(key, step))
    result = _drive(engine)
    result["computed_ticks"] = computed
    result["moved"] = getattr(engine, "moved", 0)
    return result


@pytest.fixture(scope="module")
def reference() -> dict:
    """The scenario on one process, and Hugging Face's greedy tokens for every finished request."""
    from tests.test_model import hugging_face_twin

    model = _model()
    one = _drive(LLMEngine.from_model(model, ByteTokenizer(), EngineConfig(**ENGINE)))
    hf = hugging_face_twin(model)
    wanted = {f"r{i}": (p, n) for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))} | LATE
    one["hf"] = {}
    for rid, (prompt, n) in wanted.items():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        one["hf"][rid] = out[0, len(prompt):].tolist()
    return one


def _check(results: list[dict], reference: dict) -> None:
    assert reference["tokens"] == reference["hf"]
    for r in results:
        assert r["tokens"] == reference["tokens"]
        assert r["blocks_used"] == 0
        for (lp, top), (want_lp, want_top) in zip(r["logprobs"]["r3"], reference["logprobs"]["r3"]):
            assert lp == pytest.approx(want_lp, abs=1e-9)
            assert [t for t, _ in top] == [t for t, _ in want_top]
        assert len(r["logprobs"]["r3"]) == MAX_TOKENS[3]


@pytest.mark.parametrize("stages", [2, 4])
def test_micro_batched_pipeline_generates_what_one_process_and_hugging_face_generate(stages, reference):
    results = run_ranks(_pp_rank, world_size=stages, args=(True,))
    _check(results, reference)
    for stage, r in enumerate(results):
        ticks = r["computed_ticks"]
        # Overlap: in S consecutive ticks a stage runs S different micro-batches' steps, so it computes at
        # (nearly) every tick; one step in flight would compute at most every S-th tick.
        assert len(ticks) > 1.5 * r["steps"] / stages, f"stage {stage} computed {len(ticks)} of {r['steps']} ticks"
        assert any(b - a == 1 for a, b in zip(ticks, ticks[1:]))


def test_micro_batches_that_run_out_of_blocks_preempt_and_still_generate_the_same_tokens(reference):
    results = run_ranks(_pp_rank, world_size=2, args=(True, {"num_kv_blocks": 24}))  # shares of 11 blocks each
    _check(results, reference)
    assert all(r["preemptions"] > 0 for r in results)


def test_queued_requests_move_to_a_micro_batch_with_nothing_waiting(reference):
    results = run_ranks(_pp_rank, world_size=2, args=(True, {"max_num_seqs": 1}))  # queues in each micro-batch
    _check(results, reference)
    assert all(r["moved"] > 0 for r in results)


def test_plain_pipeline_when_micro_batching_is_off(reference):
    _check(run_ranks(_pp_rank, world_size=2, args=(False,)), reference)


SERVE_PROMPTS = ["def f(x):", "ab", "class Stack:\n    def push", "0123456789"]


def _serve_rank(rank: int, world_size: int, run_dir: str) -> dict | None:
    import asyncio

    from fourfold.serve.engine_setup import open_engine

    engine = open_engine(run_dir, device="cpu", dtype="fp64", pp=world_size, config=EngineConfig(**ENGINE))
    if engine is None:  # the follower: rank 0 has shut down
        return None

    async def one(i: int, prompt: str) -> list[int]:
        tokens = []
        async for out in engine.generate(str(i), prompt, _params(4 + i)):
            tokens += out.token_ids
        return tokens

    async def everything():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(SERVE_PROMPTS)))

    try:
        return {"tokens": asyncio.run(everything()), "micro_batches": len(engine.engine.engines)}
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_serve_pp2_engine_streams_what_one_process_generates(tmp_path):
    from fourfold.infer.llm import LLM
    from fourfold.testing.runs import tiny_config
    from fourfold.train.trainer import train

    train(tiny_config(tmp_path, **{"train.steps": "1", "checkpoint.save_final": "true", "model.init_std": "0.4",
                                   "optim.lr": "1e-6"}), tmp_path / "run")
    one = LLM(tmp_path / "run", dtype=torch.float64, **ENGINE)
    want = [r.token_ids for r in one.generate(SERVE_PROMPTS, [_params(4 + i) for i in range(len(SERVE_PROMPTS))],
                                              progress=False)]
    leader, follower = run_ranks(_serve_rank, world_size=2, args=(str(tmp_path / "run"),))
    assert follower is None and leader["micro_batches"] == 2
    assert leader["tokens"] == want
