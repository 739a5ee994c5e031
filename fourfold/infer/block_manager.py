"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, per-sequence block tables, prefix caching.

The pool holds `num_blocks` blocks of `block_size` token slots each (fourfold.infer.kv_pool owns the
tensors; this module only hands out ids). A block has a reference count: the sequences whose table
holds it. A sequence grows its table a block at a time as its tokens are scheduled.

Prefix caching: when a block is full, its content hash is registered, chained over the whole prefix
(the key is (hash of the previous block's key, this block's tokens)), so two prompts share a block
only when every token before it is the same too. A new sequence looks its leading full blocks up and
takes references instead of recomputing them. Blocks nobody references but that hold a registered
hash stay in an LRU list: they can still be hit, and are evicted (oldest first) only when no plain free
block is left. The last prompt token is never taken from the cache, so the model always runs at least
one token of a prompt (its logits pick the first generated token) and never writes into a shared block.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from fourfold.infer.block_rows import BlockRows
from fourfold.infer.sequence import Sequence


class BlockManager:
    """Allocates pool blocks to sequences, counts references and reuses full blocks by content hash."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be at least 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()
        """Unreferenced blocks that still hold a registered hash, least recently used first."""
        self.hash_to_block: dict[int, int] = {}
        self.block_hash: dict[int, int] = {}
        self.queries = self.hits = 0
        self.rows = BlockRows(fill=num_blocks)
        """Every table also as a row of one array (padded with the pool's scratch block, id num_blocks)."""

    # -- pool state -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks a sequence can get now: plain free ones and evictable cached ones."""
        return len(self.free) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # -- prefix cache -----------------------------------------------------------------------------
    @staticmethod
    def chain_hash(parent: int | None, tokens: list[int]) -> int:
        """The content hash of a full block whose prefix hashed to `parent` (None for the first block)."""
        return hash((parent, tuple(tokens)))

    def match_prefix(self, seq: Sequence) -> int:
        """Give `seq` (empty table) references to its cached leading full blocks; return the tokens they cover."""
        assert not seq.block_table and seq.num_computed == 0
        if not self.enable_prefix_caching:
            return 0
        tokens, bs = seq.token_ids, self.block_size
        matchable = (len(tokens) - 1) // bs  # keep at least the last token to compute
        parent = None
        for i in range(matchable):
            h = self.chain_hash(parent, tokens[i * bs:(i + 1) * bs])
            block = self.hash_to_block.get(h)
            if block is None:
                break
            self._take(block)
            seq.block_table.append(block)
            self.rows.append(seq, block)
            seq.block_hashes.append(h)
            parent = h
        matched = len(seq.block_table) * bs
        seq.num_computed = matched
        return matched

    def count_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        """Add one admitted request's prompt lookup to the hit-rate counters."""
        self.queries += prompt_tokens
        self.hits += hit_tokens

    def register_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of `seq`'s blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed // bs, len(seq.block_table))
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = seq.tokens_between(i * bs, (i + 1) * bs)
            if -1 in tokens:  # the engine's placeholder for a token not read back yet: hash it next time
                break
            h = self.chain_hash(parent, tokens)
            block = seq.block_table[i]
            if h not in self.hash_to_block and block not in self.block_hash:
                self.hash_to_block[h] = block
                self.block_hash[block] = h
            seq.block_hashes.append(h)

    # -- allocation -------------------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            self.cached.pop(block, None)
        self.ref_counts[block] += 1

    def _new_block(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:  # evict the least recently used cached block
            block, _ = self.cached.popitem(last=False)
            del self.hash_to_block[self.block_hash.pop(block)]
        self.ref_counts[block] = 1
        return block

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq`'s table can cover `num_tokens` tokens with the blocks free now."""
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Extend `seq`'s table to cover `num_tokens` tokens; False (nothing taken) when blocks run out."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_free:
            return False
        for _ in range(max(need, 0)):
            seq.block_table.append(self._new_block())
            self.rows.append(seq, seq.block_table[-1])
        return True

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks at zero go back to the pool (kept for hits if hashed)."""
        self.rows.release(seq)
        for block in reversed(seq.block_table):  # the tail is evicted before the prefix it extends
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} released more often than taken"
            if self.ref_counts[block] == 0:
                if block in self.block_hash:
                    self.cached[block] = None
                else:
                    self.free.append(block)
        seq.block_table, seq.block_hashes = [], []
        seq.num_computed = 0
