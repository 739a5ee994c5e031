"""Attention over the paged KV cache: the contract every kernel implements, its PyTorch reference, the step object.

    out = paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale)

q (T, hq, d): this step's queries, sequences concatenated; k_cache / v_cache (num_blocks, block_size,
hkv, d): one layer's pool, this step's keys and values already written; block_tables (S, max_blocks)
int32; seq_lens (S,) int32: tokens cached per sequence after this step's writes; query_start (S+1,)
int32: sequence i's queries are q[query_start[i]:query_start[i+1]], its LAST n_i tokens, so query j
sits at position seq_lens[i] - n_i + j and attends to cached positions 0..its own. Returns (T, hq, d).
Grouped-query aware: each kv head serves its group of query heads, K and V are never repeated.

`paged_attention_reference` is the plain PyTorch definition (one SDPA per sequence) that tests hold
the kernels to. `PagedStep` is the model's attention-cache object (fourfold.models.attention) for one
engine step: it writes each layer's new keys and values into the pool at the step's slot mapping with
an index op and runs the GPU kernel (fourfold.infer.attention_gpu, on CUDA when it is installed, for the
dtypes it takes: attention_gpu.runs_on) or else (CPU, or float64 on a GPU) `TorchAttentionPlan`: the
reference's work with the index tensors and masks built once per step instead of once per layer, and all
decoding sequences in one batched SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fourfold.infer import attention_gpu
from fourfold.infer.kv_pool import KVPool
from fourfold.infer.step_tensors import StepTensors


def _sequence_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat pool slots (length,) of positions 0..length-1 of a sequence with this block table."""
    pos = torch.arange(length, device=block_table.device)
    return block_table[pos // block_size].long() * block_size + pos % block_size


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """The contract above in plain PyTorch, one causal SDPA per sequence (slow; the definition)."""
    _, block_size, hkv, d = k_cache.shape
    flat_k, flat_v = k_cache.reshape(-1, hkv, d), v_cache.reshape(-1, hkv, d)
    out = torch.empty_like(q)
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for i, length in enumerate(lens):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        slots = _sequence_slots(block_tables[i], length, block_size)
        keys, values = flat_k[slots].transpose(0, 1), flat_v[slots].transpose(0, 1)  # (hkv, L, d)
        q_pos = torch.arange(length - (b - a), length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]
        out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), keys, values, attn_mask=mask, scale=scale,
                                                  enable_gqa=keys.shape[0] != q.shape[1]).transpose(0, 1)
    return out


class TorchAttentionPlan:
    """Index tensors and masks for one step's attention, shared by every layer (torch's SDPA: the CPU path, and a
    float64 model on a GPU), made on the step tensors' device.

    Sequences with one query (decodes) run together: their keys gathered to (S_dec, hkv, L_max, d) with a
    length mask. Each sequence with several queries (a prefill chunk) runs alone with a causal mask.
    """

    def __init__(self, st: StepTensors, block_size: int):
        starts, lens = st.query_start.tolist(), st.seq_lens.tolist()
        decode = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
        dev = st.block_tables.device
        self.decode_rows = torch.tensor([starts[i] for i in decode], dtype=torch.long, device=dev)
        self.all_decode = len(decode) == len(lens) == starts[-1]  # q rows are the decode rows, in order
        if decode:
            longest = max(lens[i] for i in decode)
            pos = torch.arange(longest, device=dev)
            rows = torch.tensor(decode, device=dev) if len(decode) < len(lens) else slice(None)
            blocks = st.block_tables[rows][:, pos // block_size].long()  # the longest fits the table's width
            self.decode_slots = blocks * block_size + pos % block_size  # (S_dec, L_max)
            decode_lens = torch.tensor([lens[i] for i in decode], device=dev)
            self.decode_mask = (pos[None, :] < decode_lens[:, None])[:, None, None]
        self.prefills = []
        for i in range(len(lens)):
            a, b = starts[i], starts[i + 1]
            if b - a > 1:
                slots = _sequence_slots(st.block_tables[i], lens[i], block_size)
                q_pos = torch.arange(lens[i] - (b - a), lens[i], device=dev)
                mask = torch.arange(lens[i], device=dev)[None, :] <= q_pos[:, None]
                self.prefills.append((a, b, slots, mask))

    def attend(self, q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention (T, hq, d) of q over the pool's flat (slots, hkv, d) keys and values."""
        gqa = flat_k.shape[1] != q.shape[1]
        if self.all_decode:
            keys, values = flat_k[self.decode_slots].transpose(1, 2), flat_v[self.decode_slots].transpose(1, 2)
            return F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=self.decode_mask, scale=scale,
                                                  enable_gqa=gqa)[:, :, 0]
        out = torch.empty_like(q)
        if len(self.decode_rows):
            keys = flat_k[self.decode_slots].transpose(1, 2)  # (S_dec, hkv, L, d)
            values = flat_v[self.decode_slots].transpose(1, 2)
            qd = q[self.decode_rows][:, :, None]  # (S_dec, hq, 1, d)
            out[self.decode_rows] = F.scaled_dot_product_attention(
                qd, keys, values, attn_mask=self.decode_mask, scale=scale, enable_gqa=gqa)[:, :, 0]
        for a, b, slots, mask in self.prefills:
            keys, values = flat_k[slots].transpose(0, 1), flat_v[slots].transpose(0, 1)
            out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), keys, values, attn_mask=mask,
                                                      scale=scale, enable_gqa=gqa).transpose(0, 1)
        return out


class PagedStep:
    """The model's attention cache for one engine step over a KVPool (tokens flattened into batch 1)."""

    def __init__(self, pool: KVPool, st: StepTensors, use_gpu_kernel: bool | None = None):
        self.pool, self.st = pool, st
        if use_gpu_kernel is None:
            use_gpu_kernel = attention_gpu.runs_on(st.tokens.device, pool.keys.dtype)
        self.kernel = attention_gpu.paged_attention if use_gpu_kernel else None
        self.plan = None if self.kernel is not None else TorchAttentionPlan(st, pool.block_size)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write k, v (1, hkv, T, d) at the step's slots of layer `layer_idx`; attention (1, hq, T, d)."""
        k_cache, v_cache = self.pool.layer(layer_idx)
        hkv, d = k.shape[1], k.shape[3]
        flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
        flat_k.index_copy_(0, self.st.slot_mapping, k[0].transpose(0, 1).to(flat_k.dtype))
        flat_v.index_copy_(0, self.st.slot_mapping, v[0].transpose(0, 1).to(flat_v.dtype))
        qt = q[0].transpose(0, 1)  # (T, hq, d)
        scale = d ** -0.5
        if self.kernel is not None:
            out = self.kernel(qt, k_cache, v_cache, self.st.block_tables, self.st.seq_lens, self.st.query_start, scale)
        else:
            out = self.plan.attend(qt, flat_k, flat_v, scale)
        return out.transpose(0, 1)[None]
