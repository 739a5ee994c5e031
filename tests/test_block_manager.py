"""Block manager: reference counts, prefix hits chained over the whole prefix, LRU eviction of cached blocks,
and every block free again after any mix of finished, aborted and preempted requests."""

import random

from fourfold.infer.block_manager import BlockManager
from fourfold.infer.requests import SamplingParams
from fourfold.infer.sequence import Sequence


def seq(tokens, i=0):
    return Sequence(f"r{i}", list(tokens), SamplingParams(), i)


def compute(bm, s, n=None):
    """Pretend the model ran the sequence's tokens: grow, advance, register full blocks."""
    n = s.num_tokens if n is None else n
    assert bm.grow(s, n)
    s.num_computed = n
    bm.register_full_blocks(s)


def all_free(bm):
    return bm.num_free == bm.num_blocks and all(r == 0 for r in bm.ref_counts)


def test_prefix_hit_shares_blocks_and_keeps_the_last_token_to_compute():
    bm = BlockManager(8, 4)
    a = seq(range(12))
    compute(bm, a)
    b = seq(range(12), 1)
    assert bm.match_prefix(b) == 8  # 3 full blocks, but the last token must be computed: 2 blocks
    assert b.block_table == a.block_table[:2] and bm.ref_counts[a.block_table[0]] == 2
    c = seq(list(range(4)) + [99] * 4 + list(range(8, 12)), 2)
    assert bm.match_prefix(c) == 4  # block 3 has the same tokens as a's, but a different prefix


def test_released_hashed_blocks_are_hit_again_then_evicted_oldest_first():
    bm = BlockManager(4, 2)
    a = seq([1, 2, 3, 4, 5])
    compute(bm, a)
    bm.release(a)
    assert all_free(bm) and len(bm.cached) == 2
    again = seq([1, 2, 3, 4, 9], 1)
    assert bm.match_prefix(again) == 4
    bm.release(again)
    filler = seq(range(10, 16), 2)
    assert bm.grow(filler, 6)  # 3 blocks: 2 plain free ones, then the LRU cached block ([3, 4], the tail)
    assert len(bm.cached) == 1 and bm.match_prefix(seq([1, 2, 3, 4, 5], 3)) == 2


def test_grow_takes_nothing_when_blocks_run_out():
    bm = BlockManager(3, 4)
    a = seq(range(20))
    assert not bm.grow(a, 20) and a.block_table == [] and all_free(bm)


def test_every_block_is_free_after_a_random_mix():
    rng = random.Random(0)
    bm = BlockManager(24, 4)
    shared = list(range(8))
    live, matched = [], 0
    for i in range(300):
        action = rng.random()
        if action < 0.4 or not live:
            tokens = (shared if rng.random() < 0.5 else []) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            s = seq(tokens, i)
            matched += bm.match_prefix(s)
            if bm.grow(s, s.num_tokens):
                compute(bm, s)
                live.append(s)
            else:
                bm.release(s)
        elif action < 0.7:
            s = rng.choice(live)  # decode a few tokens
            s.output_ids.append(rng.randrange(50))
            if bm.grow(s, s.num_tokens):
                compute(bm, s)
            else:  # preempted: blocks freed, it may come back later
                bm.release(s)
                live.remove(s)
        else:  # finished or aborted
            s = live.pop(rng.randrange(len(live)))
            bm.release(s)
        assert bm.num_used + bm.num_free == bm.num_blocks
        assert sum(bm.ref_counts) == sum(len(s.block_table) for s in live)
    for s in live:
        bm.release(s)
    assert all_free(bm)
    assert matched > 0
