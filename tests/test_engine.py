"""The engine's greedy output equals Hugging Face `generate` token for token: one request, a ragged batch,
chunked prefill under a small token budget, a pool so small that sequences are preempted, prefix-cache hits."""

import pytest

from fourfold.infer.cuda_graphs import DecodeGraphs
from fourfold.infer.step_tensors import StepTensors

from fourfold.errors import ConfigError
from fourfold.infer.requests import SamplingParams
from tests.engine_helpers import GREEDY, Twin, run_to_end

PROMPTS = [[3, 14, 15, 9, 26], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7], [40, 41, 42, 43, 44, 45, 46, 47]]


@pytest.fixture(scope="module")
def twin():
    return Twin()


def check_against_hf(twin, engine, prompts, n=GREEDY.max_tokens):
    got, _ = run_to_end(engine, {str(i): (p, GREEDY) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        assert got[str(i)] == twin.hf_greedy(p, n), f"prompt {i}"
    assert engine.blocks.num_used == 0 or engine.cfg.enable_prefix_caching
    assert all(r == 0 for r in engine.blocks.ref_counts)


def test_one_request_equals_hugging_face(twin):
    check_against_hf(twin, twin.engine(), PROMPTS[:1])


def test_ragged_batch_equals_hugging_face(twin):
    check_against_hf(twin, twin.engine(), PROMPTS)


def test_chunked_prefill_with_a_small_budget_equals_hugging_face(twin):
    engine = twin.engine(max_num_batched_tokens=3)
    check_against_hf(twin, engine, PROMPTS)


def test_prefill_first_scheduling_equals_hugging_face(twin):
    engine = twin.engine(max_num_batched_tokens=3, enable_chunked_prefill=False)
    check_against_hf(twin, engine, PROMPTS)


def test_preempted_run_equals_hugging_face(twin):
    engine = twin.engine(num_kv_blocks=8)  # 4 requests of up to 21 tokens (6 blocks) cannot all stay
    check_against_hf(twin, engine, PROMPTS)
    assert engine.stats().preemptions > 0


def test_prefix_cache_hits_give_the_same_tokens(twin):
    engine = twin.engine()
    shared = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    first, _ = run_to_end(engine, {"a": (shared + [1, 2], GREEDY)})
    second, steps = run_to_end(engine, {"b": (shared + [3], GREEDY), "c": (shared + [1, 2], GREEDY)})
    assert first["a"] == twin.hf_greedy(shared + [1, 2], 10) == second["c"]
    assert second["b"] == twin.hf_greedy(shared + [3], 10)
    cached = {o.request_id: o.cached_prompt_tokens for outs in steps for o in outs}
    assert cached == {"b": 8, "c": 8}  # two full blocks of 4; the last prompt token is always computed
    stats = engine.stats()
    assert stats.prefix_cache_hits == 16 and stats.prefix_cache_queries == 11 + 10 + 11


def test_prefix_caching_off_computes_everything(twin):
    engine = twin.engine(enable_prefix_caching=False)
    run_to_end(engine, {"a": (PROMPTS[1], GREEDY)})
    _, steps = run_to_end(engine, {"b": (PROMPTS[1], GREEDY)})
    assert all(o.cached_prompt_tokens == 0 for outs in steps for o in outs)
    assert engine.blocks.num_used == 0


def test_max_tokens_eos_and_context_end_requests(twin):
    engine = twin.engine()
    greedy = twin.hf_greedy(PROMPTS[0], 10)
    eos = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[greedy[3]])
    long_prompt = list(range(60))
    got, steps = run_to_end(engine, {"eos": (PROMPTS[0], eos), "len": (long_prompt, GREEDY),
                                     "max": (PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0))})
    reasons = {o.request_id: o.finish_reason for outs in steps for o in outs if o.finished}
    assert reasons == {"eos": "stop", "len": "length", "max": "length"}
    assert got["eos"] == greedy[:greedy.index(greedy[3]) + 1]
    assert len(got["len"]) == 64 - 60 and len(got["max"]) == 2


def test_requests_that_can_never_fit_are_refused(twin):
    engine = twin.engine(num_kv_blocks=4)
    with pytest.raises(ConfigError, match="KV-cache blocks"):
        engine.add_request("big", list(range(10)), SamplingParams(max_tokens=20))
    with pytest.raises(ConfigError, match="max_model_len"):
        engine.add_request("long", list(range(65)), GREEDY)
    with pytest.raises(ConfigError, match="empty prompt"):
        engine.add_request("empty", [], GREEDY)


def test_decode_through_padded_graph_buffers_equals_hugging_face(twin):
    """The CUDA-graph wrapper's padded static inputs (run eagerly on CPU) around the runner's decode_forward."""
    engine = twin.engine()
    runner = engine.runner
    runner.graphs = DecodeGraphs(lambda *t: runner.decode_forward(StepTensors(*t)), max_batch=8, max_blocks=16,
                                 block_size=4, scratch_block=runner.pool.scratch_block, device="cpu",
                                 batch_sizes=(2, 8))
    staged, greedy = [], []
    stage, forward_greedy = runner.graphs.stage, runner.forward_greedy
    runner.graphs.stage = lambda *a: staged.append(stage(*a)) or staged[-1]
    runner.forward_greedy = lambda st: greedy.append(forward_greedy(st)) or greedy[-1]
    check_against_hf(twin, engine, PROMPTS[:3])
    # every decode step went into the graph buffers by stage and took the graph's argmax, prefills did neither
    decodes = [st for st in staged if st is not None]
    assert decodes and len(decodes) == len([ids for ids in greedy if ids is not None])
    assert len(staged) - len(decodes) == len(greedy) - len(decodes) >= 1


def test_blocks_are_all_free_after_finished_aborted_and_preempted_requests(twin):
    engine = twin.engine(num_kv_blocks=8, max_num_batched_tokens=5)
    for i, p in enumerate(PROMPTS * 2):
        engine.add_request(str(i), p, GREEDY)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 3:
            engine.abort_request("1")  # running
            engine.abort_request("7")  # still waiting
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.running == stats.waiting == 0
    assert all(r == 0 for r in engine.blocks.ref_counts) and engine.blocks.num_free == 8
