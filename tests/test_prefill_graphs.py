"""Prefill graphs' CPU-visible logic: token-count buckets, padded steps (one sequence's prompt or chunk, or several
sequences' chunks and decode tokens together) that give the unpadded step's logits and write only the scratch block
beyond the sequences' own, and the engine's greedy output through them."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fourfold.infer.prefill_graphs import PrefillGraphs, sequence_slots, token_sizes_up_to
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


def test_sequence_slots_stay_below_the_token_count():
    assert sequence_slots(16, 1) == 2 and sequence_slots(3, 256) == 2   # one sequence and its padding
    assert sequence_slots(16, 256) == 15 and sequence_slots(512, 256) == 257 and sequence_slots(512, 4) == 5
    assert all(sequence_slots(p, m) < p for p in (3, 8, 16, 512) for m in (1, 7, 256))


def one_sequence_step(tokens: list[int], start: int, table: list[int], samples: bool = True) -> StepTensors:
    """A step of one sequence: `tokens` at positions start.., its blocks `table`."""
    positions = torch.arange(start, start + len(tokens))
    tables = torch.tensor([table], dtype=torch.int32)
    slots = tables[0].long()[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    return StepTensors(torch.tensor(tokens), positions, slots, tables,
                       torch.tensor([start + len(tokens)], dtype=torch.int32),
                       torch.tensor([0, len(tokens)], dtype=torch.int32),
                       torch.tensor([len(tokens) - 1] if samples else [], dtype=torch.long))


def mixed_step(parts: list[tuple[list[int], int, list[int]]], scratch: int,
               sampled: list[int] | None = None) -> StepTensors:
    """A step of several sequences, each (tokens at positions start.., start, its blocks); every sequence samples
    unless `sampled` lists the ones that do."""
    tokens, positions, slots, lens, starts, last = [], [], [], [], [0], []
    width = max(len(table) for _, _, table in parts)
    tables = torch.full((len(parts), width), scratch, dtype=torch.int32)
    for i, (toks, start, table) in enumerate(parts):
        pos = torch.arange(start, start + len(toks))
        tables[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        tokens += toks
        positions.append(pos)
        slots.append(tables[i].long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        lens.append(start + len(toks))
        starts.append(starts[-1] + len(toks))
        last.append(starts[-1] - 1)
    rows = last if sampled is None else [last[i] for i in sampled]
    return StepTensors(torch.tensor(tokens), torch.cat(positions), torch.cat(slots), tables,
                       torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                       torch.tensor(rows, dtype=torch.long))


def host_arrays(st: StepTensors) -> tuple:
    return tuple(t.numpy() for t in (st.tokens, st.positions, st.slot_mapping, st.block_tables, st.seq_lens,
                                     st.query_start, st.logits_for))


def cpu_upload(values: np.ndarray, dtype: torch.dtype, out: torch.Tensor) -> torch.Tensor:
    return out[:len(values)].copy_(torch.from_numpy(values))


def assert_runs_like_the_unpadded_step(graphs, runner, st, staged: bool, own_blocks: list[int]) -> None:
    """The graph path (staged from host arrays, or loaded from `st`) gives the eager step's logits and pool writes,
    and writes no block but `own_blocks` and the scratch block."""
    pool = runner.pool
    assert graphs.can_run(st)
    into = graphs.stage(host_arrays(st), cpu_upload) if staged else st
    before = (pool.keys.clone(), pool.values.clone())
    expected = runner.decode_forward(st)
    after = (pool.keys.clone(), pool.values.clone())
    pool.keys.copy_(before[0])
    pool.values.copy_(before[1])
    got = graphs.run(into)
    assert got.shape == expected.shape == (len(st.logits_for), expected.shape[1])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    others = [b for b in range(pool.num_blocks) if b not in own_blocks]
    for now, then, old in zip((pool.keys, pool.values), after, before):
        torch.testing.assert_close(now[:, own_blocks], then[:, own_blocks], rtol=1e-12, atol=1e-12)  # the step's keys
        assert torch.equal(now[:, others], old[:, others])   # padding wrote nowhere but the scratch block


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
        assert_runs_like_the_unpadded_step(graphs, runner, st, staged=i % 2 == 1, own_blocks=table)
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


def test_mixed_steps_pad_into_sequence_slots(twin):
    runner = twin.engine(block_size=BLOCK_SIZE).runner
    scratch = runner.pool.scratch_block
    graphs = PrefillGraphs(lambda *t: runner.decode_forward(StepTensors(*t)), max_tokens=16, max_blocks=8,
                           block_size=BLOCK_SIZE, scratch_block=scratch, device=torch.device("cpu"), max_seqs=7,
                           token_sizes=(8, 16))
    assert graphs.inputs[8].seqs == 7 and graphs.inputs[16].seqs == 8 and graphs.inputs[16].sampled == 7
    t = [[5, 2], [9, 0, 3], [7], [11, 12, 13], [4], [6, 8], [10]]
    prompt = [3, 14, 15, 9, 26, 5, 35, 8, 9]
    decodes = [([4], 2, t[4]), ([5], 4, t[5]), ([6], 6, t[0]), ([8], 1, t[2]), ([9], 7, t[1]), ([10], 3, t[6])]
    steps = [  # decode tokens beside a prompt's chunks, in sizes 8 and 16
        mixed_step([([7], 5, t[0]), ([1], 9, t[1]), (prompt[:5], 0, t[3])], scratch),
        mixed_step([([7], 6, t[0]), (prompt[5:], 5, t[3]), ([2], 3, t[2])], scratch, sampled=[0, 2]),
        mixed_step(decodes + [([11, 12], 2, t[3])], scratch),   # 8 tokens in all 7 of size 8's slots: no padding
        mixed_step([([1], 7, t[0]), ([2], 10, t[1]), (prompt[:7], 0, t[3])], scratch),
    ]
    assert [(len(st.tokens), len(st.seq_lens)) for st in steps] == [(7, 3), (6, 3), (8, 7), (9, 3)]
    for i, st in enumerate(steps):
        assert_runs_like_the_unpadded_step(graphs, runner, st, staged=i % 2 == 0,
                                           own_blocks=sorted({b for table in t for b in table}))
    inputs = graphs.inputs[8]
    assert inputs.holds(graphs.stage(host_arrays(steps[1]), cpu_upload))
    assert inputs.query_start.tolist() == [0, 1, 5, 6, 8, 8, 8, 8]   # the padding sequence holds tokens 6..7
    assert inputs.seq_lens.tolist() == [7, 9, 4, 2, 0, 0, 0] and inputs.logits_for[:2].tolist() == [0, 5]
    assert inputs.block_tables[3].eq(scratch).all() and inputs.slot_mapping[6:].div(
        BLOCK_SIZE, rounding_mode="floor").eq(scratch).all()
    decode_only = mixed_step(decodes[:2], scratch)
    no_slot_for_padding = mixed_step(decodes + [([3], 5, t[3]), ([1, 2, 3], 0, [14])], scratch)   # 10 tokens, 8 seqs
    too_many = mixed_step(decodes + [([3], 5, t[3]), ([2], 1, [15]), ([1, 2], 0, [14])], scratch)
    for st in (decode_only, no_slot_for_padding, too_many):
        assert not graphs.can_run(st) and graphs.stage(host_arrays(st), cpu_upload) is None
    alone = PrefillGraphs(lambda *t: runner.decode_forward(StepTensors(*t)), max_tokens=8, max_blocks=8,
                          block_size=BLOCK_SIZE, scratch_block=scratch, device=torch.device("cpu"), token_sizes=(8,))
    two_filling_the_size = mixed_step([([7], 6, t[0]), (prompt[:7], 0, t[3])], scratch, sampled=[1])
    assert graphs.can_run(two_filling_the_size) and not alone.can_run(two_filling_the_size)   # max_seqs 1


@pytest.mark.parametrize("together", [False, True])
def test_engine_through_prefill_graphs_equals_hugging_face(twin, together):
    engine = twin.engine(max_num_batched_tokens=6)   # prompts in chunks, some sharing a step with decodes
    runner = engine.runner
    runner.prefill_graphs = PrefillGraphs(lambda *t: runner.decode_forward(StepTensors(*t)), max_tokens=8,
                                          max_blocks=16, block_size=4, scratch_block=runner.pool.scratch_block,
                                          device=torch.device("cpu"), max_seqs=4, token_sizes=(4, 8))
    ran = []
    run = runner.prefill_graphs.run
    runner.prefill_graphs.run = lambda st: ran.append((st.tokens.shape[0], st.seq_lens.shape[0])) or run(st)
    prompts = [[3, 14, 15, 9, 26], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43, 44, 45, 46, 47]]
    batches = [dict(enumerate(prompts))] if together else [{i: p} for i, p in enumerate(prompts)]
    for batch in batches:
        got, _ = run_to_end(engine, {str(i): (p, GREEDY) for i, p in batch.items()})
        for i, p in batch.items():
            assert got[str(i)] == twin.hf_greedy(p, GREEDY.max_tokens), f"prompt {i}"
    if not together:   # one request at a time: every prefill step has one sequence
        assert sorted(set(ran)) == [(2, 1), (5, 1), (6, 1)]   # 5; 6 + 5 (chunked, with its cached prefix); 6 + 2
    else:   # chunks beside other requests' decode tokens ran from the graphs too
        assert any(seqs > 1 for _, seqs in ran) and all(tokens > seqs for tokens, seqs in ran)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_cuda_mixed_step_graphs_give_the_eager_steps_tokens(twin):
    """On a GPU: the same requests together, steps that mix chunks and decodes from graphs (the default) or eagerly
    (prefill_graph_seqs=1): the same greedy tokens, Hugging Face's; the graphs did run mixed steps."""
    from fourfold.infer.engine import LLMEngine
    from fourfold.infer.engine_config import EngineConfig
    from fourfold.tokenizer import ByteTokenizer

    model = copy.deepcopy(twin.model).float().cuda()
    prompts = [[3, 14, 15, 9, 26], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43, 44, 45, 46, 47], [7, 8]]
    results, ran = {}, []
    for seqs in (0, 1):
        engine = LLMEngine.from_model(model, ByteTokenizer(), EngineConfig(
            block_size=4, num_kv_blocks=64, max_num_batched_tokens=7, prefill_graph_seqs=seqs), torch.device("cuda"))
        graphs = engine.runner.prefill_graphs
        assert graphs is not None and graphs.graphs
        run = graphs.run
        graphs.run = lambda st, run=run, seqs=seqs: ran.append((seqs, st.seq_lens.shape[0])) or run(st)
        results[seqs], _ = run_to_end(engine, {str(i): (p, GREEDY) for i, p in enumerate(prompts)})
    assert results[0] == results[1]
    for i, p in enumerate(prompts):
        assert results[0][str(i)] == twin.hf_greedy(p, GREEDY.max_tokens), f"prompt {i}"
    assert any(seqs == 0 and n > 1 for seqs, n in ran), ran
    assert all(n == 1 for seqs, n in ran if seqs == 1), ran
