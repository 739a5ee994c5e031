"""Prefill graphs' CPU-visible logic: token-count buckets, padded one-sequence steps that give the unpadded step's
logits and write only the scratch block beyond the sequence's own, and the engine's greedy output through them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fourfold.infer.prefill_graphs import PrefillGraphs, token_sizes_up_to
from fourfold.infer.step_tensors import StepTensors
from tests.engine_helpers import GREEDY, Twin, run_to_end

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def twin():
    return Twin()


def test_token_sizes():
    assert token_sizes_up_to(100) == [16, 32, 48, 64, 96, 100]
    assert token_sizes_up_to(512)[-3:] == [256, 384, 512]
    assert token_sizes_up_to(10) == [10] and token_sizes_up_to(0) == [] and token_sizes_up_to(2) == []


def one_sequence_step(tokens: list[int], start: int, table: list[int], samples: bool = True) -> StepTensors:
    """A step of one sequence: `tokens` at positions start.., its blocks `table`."""
    positions = torch.arange(start, start + len(tokens))
    tables = torch.tensor([table], dtype=torch.int32)
    slots = tables[0].long()[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    return StepTensors(torch.tensor(tokens), positions, slots, tables,
                       torch.tensor([start + len(tokens)], dtype=torch.int32),
                       torch.tensor([0, len(tokens)], dtype=torch.int32),
                       torch.tensor([len(tokens) - 1] if samples else [], dtype=torch.long))


def host_arrays(st: StepTensors) -> tuple:
    return tuple(t.numpy() for t in (st.tokens, st.positions, st.slot_mapping, st.block_tables, st.seq_lens,
                                     st.query_start, st.logits_for))


def cpu_upload(values: np.ndarray, dtype: torch.dtype, out: torch.Tensor) -> torch.Tensor:
    return out[:len(values)].copy_(torch.from_numpy(values))


def test_padded_steps_match_the_unpadded_step_and_touch_only_scratch(twin):
    runner = twin.engine(block_size=BLOCK_SIZE).runner
    pool = runner.pool
    graphs = PrefillGraphs(lambda *t: runner.decode_forward(StepTensors(*t)), max_tokens=16, max_blocks=8,
                           block_size=BLOCK_SIZE, scratch_block=pool.scratch_block, device=torch.device("cpu"),
                           token_sizes=(8, 16))
    graphs.capture()  # nothing to capture on CPU
    prompt = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 32, 38]
    table = [5, 2, 9, 0]
    steps = [  # a whole prompt in the 16 bucket, then chunks with a cached prefix re-padding the 8 bucket
        one_sequence_step(prompt, 0, table),
        one_sequence_step(prompt[:7], 0, table, samples=False),
        one_sequence_step(prompt[7:10], 7, table, samples=False),
        one_sequence_step(prompt[10:], 10, table),
    ]
    for i, st in enumerate(steps):
        assert graphs.can_run(st)
        staged = graphs.stage(host_arrays(st), cpu_upload) if i % 2 else st   # both ways in
        before = (pool.keys.clone(), pool.values.clone())
        expected = runner.decode_forward(st)
        after = (pool.keys.clone(), pool.values.clone())
        pool.keys.copy_(before[0])
        pool.values.copy_(before[1])
        got = graphs.run(staged)
        assert got.shape == expected.shape == (len(st.logits_for), twin.model.cfg.vocab_size)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        others = [b for b in range(pool.num_blocks) if b not in table]
        for now, then, old in zip((pool.keys, pool.values), after, before):
            torch.testing.assert_close(now[:, table], then[:, table], rtol=1e-12, atol=1e-12)  # the step's own keys
            assert torch.equal(now[:, others], old[:, others])   # padding wrote nowhere but the scratch block
    inputs = graphs.inputs[8]
    assert inputs.holds(graphs.stage(host_arrays(steps[2]), cpu_upload))
    assert inputs.query_start.tolist() == [0, 3, 8] and inputs.seq_lens.tolist() == [10, 5]
    assert inputs.block_tables[1].eq(pool.scratch_block).all() and inputs.block_tables[0, 4:].eq(pool.scratch_block).all()
    assert inputs.slot_mapping[3:].div(BLOCK_SIZE, rounding_mode="floor").eq(pool.scratch_block).all()
    two = StepTensors(*(torch.cat([t, t]) for t in (steps[0].tokens, steps[0].positions, steps[0].slot_mapping)),
                      steps[0].block_tables.repeat(2, 1), steps[0].seq_lens.repeat(2),
                      torch.tensor([0, 13, 26], dtype=torch.int32), torch.tensor([12, 25]))
    too_long = one_sequence_step(list(range(17)), 0, table + [1])
    too_wide = one_sequence_step([1, 2], 40, list(range(11)))
    for st in (two, too_long, too_wide):
        assert not graphs.can_run(st) and graphs.stage(host_arrays(st), cpu_upload) is None


def test_engine_through_prefill_graphs_equals_hugging_face(twin):
    engine = twin.engine(max_num_batched_tokens=6)   # prompts in chunks, some sharing a step with a decode
    runner = engine.runner
    runner.prefill_graphs = PrefillGraphs(lambda *t: runner.decode_forward(StepTensors(*t)), max_tokens=8,
                                          max_blocks=16, block_size=4, scratch_block=runner.pool.scratch_block,
                                          device=torch.device("cpu"), token_sizes=(4, 8))
    ran = []
    run = runner.prefill_graphs.run
    runner.prefill_graphs.run = lambda st: ran.append(st.tokens.shape[0]) or run(st)
    prompts = [[3, 14, 15, 9, 26], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43, 44, 45, 46, 47]]
    for i, p in enumerate(prompts):   # one request at a time: every prefill step has one sequence
        got, _ = run_to_end(engine, {str(i): (p, GREEDY)})
        assert got[str(i)] == twin.hf_greedy(p, GREEDY.max_tokens), f"prompt {i}"
    assert sorted(set(ran)) == [2, 5, 6]   # 5; 6 + 5 (chunked, the second chunk with its cached prefix); 6 + 2
