"""Scheduler: the per-step token budget is never exceeded, every running decode advances every step while a
long prompt is prefilled in chunks, a request that fits later waits (first come, first served), and the
newest running sequence is preempted when blocks run out."""

import pytest

from fourfold.errors import ConfigError
from fourfold.infer.block_manager import BlockManager
from fourfold.infer.requests import SamplingParams
from fourfold.infer.scheduler import Scheduler
from fourfold.infer.sequence import Sequence


def make(num_blocks=64, block_size=4, max_seqs=8, budget=8, max_len=256):
    return Scheduler(BlockManager(num_blocks, block_size), max_seqs, budget, max_len)


def add(sched, i, prompt_len, max_tokens=8):
    first = 100 + i * 1000
    s = Sequence(f"r{i}", list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens), i)
    sched.add(s)
    return s


def fake_step(sched):
    """Schedule, 'run' the model (append token 7 to sequences that sample), finish those at max_tokens."""
    chunks = sched.schedule()
    sched.after_step(chunks)
    for c in chunks:
        if c.samples:
            c.seq.output_ids.append(7)
            if len(c.seq.output_ids) >= c.seq.params.max_tokens:
                sched.finish(c.seq, "length")
    return chunks


def test_budget_holds_and_running_decodes_advance_while_a_long_prompt_arrives():
    sched = make(budget=6)
    decoders = [add(sched, i, 3, max_tokens=40) for i in range(3)]
    while any(not s.output_ids for s in decoders):
        fake_step(sched)
    long = add(sched, 9, 50, max_tokens=2)
    prefill_steps = 0
    while not long.output_ids:
        before = {s.request_id: len(s.output_ids) for s in decoders}
        chunks = fake_step(sched)
        assert sum(c.num_tokens for c in chunks) <= 6
        assert all(len(s.output_ids) == before[s.request_id] + 1 for s in decoders)
        prefill_steps += 1
    assert prefill_steps == -(-50 // 3)  # three decode tokens per step, the other three for the prompt


def test_a_request_that_fits_later_waits_its_turn():
    sched = make(num_blocks=5, budget=64)
    first = add(sched, 0, 16, max_tokens=4)  # 4 blocks now, 5 at the end
    second = add(sched, 1, 8, max_tokens=2)  # fits alone, not beside the first
    third = add(sched, 2, 1, max_tokens=1)  # would fit, but comes after the second
    fake_step(sched)
    assert first in sched.running and list(sched.waiting) == [second, third]
    while first.finish_reason is None:
        fake_step(sched)
        assert third.num_computed == 0 or second.num_computed > 0
    while sched.has_work():
        fake_step(sched)
    assert second.finish_reason == third.finish_reason == "length"
    assert sched.blocks.num_free == 5


def test_newest_running_sequence_is_preempted_and_recomputed():
    sched = make(num_blocks=5, budget=64)
    old = add(sched, 0, 7, max_tokens=8)
    new = add(sched, 1, 7, max_tokens=8)
    fake_step(sched)  # both prefilled: 2 + 2 blocks
    while sched.preemptions == 0:
        fake_step(sched)
    assert new in sched.waiting and new.num_computed == 0 and new.block_table == []
    assert old in sched.running
    while sched.has_work():
        fake_step(sched)
    assert len(old.output_ids) == len(new.output_ids) == 8 and sched.blocks.num_free == 5


def test_max_num_seqs_caps_running_sequences():
    sched = make(max_seqs=2, budget=64)
    for i in range(4):
        add(sched, i, 2, max_tokens=3)
    for _ in range(6):
        fake_step(sched)
        assert len(sched.running) <= 2


def test_requests_that_never_fit_are_refused():
    sched = make(num_blocks=3, max_len=32)
    with pytest.raises(ConfigError, match="needs up to 4 KV-cache blocks"):
        add(sched, 0, 10, max_tokens=6)
    with pytest.raises(ConfigError, match="max_model_len"):
        add(sched, 1, 33)
