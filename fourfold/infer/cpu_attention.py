"""Attention of one engine step on the CPU, planned once per step: few, large SDPA calls and no per-slot gathers.

    plan = CpuStepAttention(st, block_size)                # host-side, once per step
    out = plan.attend(q, k, v, k_cache, v_cache, scale)    # per layer: (T, hq, d), after k, v went into the pool

Four kinds of sequences, each run the cheapest way the step allows:
- a lone decode whose blocks follow each other in the pool (the usual case at batch 1) reads its keys
  and values as a view of the pool, with no mask;
- other decodes (one query each) run together in one SDPA: their cached keys and values come out of the
  pool a whole block at a time (`index_select` of block ids, one memcpy per block instead of one index
  per slot), and each kv head's group of query heads is a short query row (no K/V repeat, no GQA
  expansion), with a length mask;
- fresh prefills (a chunk that starts at position 0: every key it sees is in this step) attend causally to
  this step's own k and v, never touching the pool; neighbours of equal length run as one batched SDPA;
- continuing chunks (after earlier chunks or a prefix-cache hit) gather their blocks and use an offset
  causal mask, one SDPA each.
Softmax statistics stay in float32 inside SDPA; results match the reference (fourfold.infer.paged_attention)
up to reduction order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fourfold.infer.step_tensors import StepTensors


class CpuStepAttention:
    """Index tensors and masks for one step's attention, shared by every layer (see the module docstring)."""

    def __init__(self, st: StepTensors, block_size: int):
        starts, lens = st.query_start.tolist(), st.seq_lens.tolist()
        self.num_tokens = starts[-1]
        self._masks: dict[tuple, torch.Tensor] = {}
        self.decode: tuple | None = None
        self.fresh: list[tuple[int, int, int]] = []  # (first row, sequences, tokens each): consecutive, equal length
        self.continuing: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (a, b, blocks, mask)
        decode_seqs = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
        self.single: tuple[int, int] | None = None  # (first slot, length): one decode whose blocks are in a row
        if len(decode_seqs) == 1 == len(lens):
            n_blocks = -(-lens[0] // block_size)
            first = int(st.block_tables[0, 0])
            if st.block_tables[0, :n_blocks].tolist() == list(range(first, first + n_blocks)):
                self.single = (first * block_size, lens[0])
                decode_seqs = []
        if decode_seqs:
            longest = max(lens[i] for i in decode_seqs)
            n_blocks = -(-longest // block_size)
            rows = torch.tensor(decode_seqs) if len(decode_seqs) < len(lens) else slice(None)
            blocks = st.block_tables[rows, :n_blocks].reshape(-1)
            pos = torch.arange(n_blocks * block_size)
            mask = pos[None, :] < torch.tensor([lens[i] for i in decode_seqs])[:, None]
            q_rows = torch.tensor([starts[i] for i in decode_seqs])
            in_order = len(decode_seqs) == self.num_tokens  # the decodes are every row, in order
            self.decode = (None if in_order else q_rows, blocks, mask[:, None, None], len(decode_seqs))
        for i in range(len(lens)):
            a, b = starts[i], starts[i + 1]
            n = b - a
            if n <= 1:
                continue
            if n == lens[i]:
                last = self.fresh[-1] if self.fresh else None
                if last is not None and last[2] == n and last[0] + last[1] * n == a:
                    self.fresh[-1] = (last[0], last[1] + 1, n)
                else:
                    self.fresh.append((a, 1, n))
            else:
                n_blocks = -(-lens[i] // block_size)
                pos = torch.arange(n_blocks * block_size)
                q_pos = torch.arange(lens[i] - n, lens[i])
                self.continuing.append((a, b, st.block_tables[i, :n_blocks], pos[None, :] <= q_pos[:, None]))

    def _additive(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`mask` (True: attend) as 0 / -inf in `dtype`, made once per step (SDPA would convert it every layer)."""
        key = (id(mask), dtype)
        if key not in self._masks:
            self._masks[key] = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
        return self._masks[key]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Attention (T, hq, d) of q (T, hq, d); k, v (T, hkv, d) are this step's, already written to the pool
        k_cache / v_cache (num_blocks, block_size, hkv, d)."""
        hq, d = q.shape[1], q.shape[2]
        hkv = k.shape[1]
        if self.single is not None:  # the pool's rows are the sequence's keys: a view, no gather, no mask
            first, length = self.single
            keys = k_cache.view(-1, hkv, d)[first:first + length].transpose(0, 1)[None]  # (1, hkv, L, d)
            values = v_cache.view(-1, hkv, d)[first:first + length].transpose(0, 1)[None]
            return F.scaled_dot_product_attention(q.view(1, hkv, hq // hkv, d), keys, values,
                                                  scale=scale).reshape(1, hq, d)
        only = len(self.fresh) + len(self.continuing) + (self.decode is not None) == 1
        out = None if only else torch.empty_like(q)
        if self.decode is not None:
            q_rows, blocks, mask, n = self.decode
            qd = q if q_rows is None else q[q_rows]
            keys = k_cache.index_select(0, blocks).view(n, -1, hkv, d).transpose(1, 2)  # (S, hkv, L, d)
            values = v_cache.index_select(0, blocks).view(n, -1, hkv, d).transpose(1, 2)
            got = F.scaled_dot_product_attention(qd.reshape(n, hkv, hq // hkv, d), keys, values,
                                                 attn_mask=self._additive(mask, q.dtype), scale=scale).reshape(n, hq, d)
            if out is None:
                return got
            out[q_rows if q_rows is not None else slice(None)] = got
        for a, count, n in self.fresh:
            rows = slice(a, a + count * n)
            got = F.scaled_dot_product_attention(
                q[rows].view(count, n, hq, d).transpose(1, 2), k[rows].view(count, n, hkv, d).transpose(1, 2),
                v[rows].view(count, n, hkv, d).transpose(1, 2), is_causal=True, scale=scale,
                enable_gqa=hkv != hq).transpose(1, 2).reshape(count * n, hq, d)
            if out is None:
                return got
            out[rows] = got
        for a, b, blocks, mask in self.continuing:
            keys = k_cache.index_select(0, blocks).view(-1, hkv, d).transpose(0, 1)  # (hkv, L, d)
            values = v_cache.index_select(0, blocks).view(-1, hkv, d).transpose(0, 1)
            got = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), keys, values,
                                                 attn_mask=self._additive(mask, q.dtype), scale=scale,
                                                 enable_gqa=hkv != hq).transpose(0, 1)
            if out is None:
                return got
            out[a:b] = got
        return out
