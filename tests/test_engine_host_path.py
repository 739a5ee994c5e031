"""The engine's vectorized host path equals the scalar computation it replaced: step tensors built with numpy
over the block manager's persistent table rows, the rows themselves, and outputs without detokenization."""

import random

import numpy as np
import pytest

from fourfold.errors import ConfigError
from fourfold.infer.block_manager import BlockManager
from fourfold.infer.requests import SamplingParams
from fourfold.infer.scheduler import ScheduledChunk
from fourfold.infer.sequence import Sequence
from fourfold.infer.step_tensors import host_step
from tests.engine_helpers import GREEDY, Twin, run_to_end


def scalar_step(chunks, block_size, scratch):
    """The per-token Python loop the model runner used before (the reference)."""
    tokens, positions, slots, lens, starts, sample_at = [], [], [], [], [0], []
    width = max(-(-(c.seq.num_computed + c.num_tokens) // block_size) for c in chunks)
    tables = []
    for c in chunks:
        seq, a = c.seq, c.seq.num_computed
        b = a + c.num_tokens
        tokens += seq.tokens_between(a, b)
        positions += range(a, b)
        slots += [seq.block_table[p // block_size] * block_size + p % block_size for p in range(a, b)]
        tables.append(seq.block_table[:width] + [scratch] * (width - len(seq.block_table[:width])))
        lens.append(b)
        starts.append(starts[-1] + c.num_tokens)
        if c.samples:
            sample_at.append(starts[-1] - 1)
    return tokens, positions, slots, tables, lens, starts, sample_at


def random_state(rng, bm):
    """Sequences at random points of prefill or decode, their blocks from `bm`, and a chunk for each."""
    chunks = []
    for i in range(rng.randrange(1, 9)):
        prompt = [rng.randrange(100) for _ in range(rng.randrange(1, 30))]
        seq = Sequence(str(i), prompt, GREEDY, i)
        seq.output_ids = [rng.randrange(100) for _ in range(rng.choice([0, 0, rng.randrange(1, 12)]))]
        seq.num_computed = rng.randrange(seq.num_tokens)
        n = rng.randrange(1, seq.num_tokens - seq.num_computed + 1)
        assert bm.grow(seq, seq.num_computed + n)
        chunks.append(ScheduledChunk(seq, n))
    return chunks


@pytest.mark.parametrize("use_rows", [True, False])
def test_numpy_step_equals_the_scalar_loop_on_random_batches(use_rows):
    rng = random.Random(1)
    for trial in range(60):
        bm = BlockManager(200, rng.choice([1, 2, 4, 16]))
        chunks = random_state(rng, bm)
        want = scalar_step(chunks, bm.block_size, bm.num_blocks)
        got = host_step(chunks, bm.block_size, bm.num_blocks, bm.rows if use_rows else None)
        for name, w, g in zip(["tokens", "positions", "slots", "tables", "lens", "starts", "sample_at"], want, got):
            assert g.tolist() == w, f"trial {trial}: {name}"
        assert [g.dtype for g in got] == [np.int64] * 3 + [np.int32] * 3 + [np.int64]
        for c in chunks:
            bm.release(c.seq)


def test_block_rows_mirror_every_table_through_a_random_mix():
    rng = random.Random(0)
    bm = BlockManager(40, 2)
    live = []
    for i in range(400):
        if rng.random() < 0.5 or not live:
            s = Sequence(str(i), [rng.randrange(4) for _ in range(rng.randrange(1, 12))], SamplingParams(), i)
            bm.match_prefix(s)
            if bm.grow(s, s.num_tokens):
                s.num_computed = s.num_tokens
                bm.register_full_blocks(s)
                live.append(s)
            else:
                bm.release(s)
        elif rng.random() < 0.6:
            s = rng.choice(live)
            s.output_ids.append(rng.randrange(4))
            if bm.grow(s, s.num_tokens):
                s.num_computed = s.num_tokens
                bm.register_full_blocks(s)
            else:
                bm.release(s)
                live.remove(s)
        else:
            bm.release(live.pop(rng.randrange(len(live))))
        rows = [s.table_row for s in live]
        assert len(set(rows)) == len(rows) and min(rows, default=0) >= 0
        for s in live:
            row = bm.rows.array[s.table_row]
            assert row[:len(s.block_table)].tolist() == s.block_table
            assert (row[len(s.block_table):] == bm.num_blocks).all()  # padded with the scratch block
    for s in live:
        bm.release(s)
    assert (bm.rows.array == bm.num_blocks).all() and all(s.table_row == -1 for s in live)


def test_outputs_without_detokenization_carry_the_same_tokens_and_no_text():
    twin = Twin()
    prompts = {str(i): p for i, p in enumerate([[3, 14, 15, 9, 26], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7]])}
    with_text, _ = run_to_end(twin.engine(), {k: (p, GREEDY) for k, p in prompts.items()})
    ids_only = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    got, steps = run_to_end(twin.engine(), {k: (p, ids_only) for k, p in prompts.items()})
    assert got == with_text
    assert all(o.text_delta == "" for s in steps for o in s)
    assert [o.finish_reason for s in steps for o in s if o.finished] == ["length"] * 3
    with pytest.raises(ConfigError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False).check()


def test_a_shared_decode_cache_gives_the_same_deltas():
    from fourfold.infer.detokenizer import IncrementalDetokenizer
    from fourfold.tokenizer import ByteTokenizer

    rng = random.Random(2)
    texts = ["añb€c d", "xé!yz 日本語", "plain ascii text"]
    cache = {}
    for text in texts * 2:
        data = list(text.encode("utf-8")) + [rng.randrange(256) for _ in range(8)]  # some invalid bytes too
        stop = [text[2:4]] if rng.random() < 0.5 else []
        runs = []
        for shared in (None, cache):
            detok, deltas = IncrementalDetokenizer(ByteTokenizer(), stop, shared), []
            for b in data:
                stopped = detok.add(b)
                deltas.append(detok.delta(finished=stopped))
                if stopped:
                    break
            detok.flush()
            runs.append((deltas, detok.delta(finished=True)))
        assert runs[0] == runs[1]
    assert cache  # it was used
