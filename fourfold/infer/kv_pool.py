"""The paged KV cache's memory: one tensor of blocks per layer for keys and one for values, sized from a budget.

    pool = KVPool(n_layers, num_blocks, block_size, kv_heads, head_dim, dtype, device)
    k_cache, v_cache = pool.layer(i)         # (num_blocks + 1, block_size, kv_heads, head_dim) each

Block ids 0..num_blocks-1 belong to the block manager; the extra last block is scratch, where padded
tokens of a CUDA-graph decode batch write. Under tensor parallelism each rank's pool holds its own kv
heads. `blocks_for_budget` turns a byte budget into a block count (CPU: a fixed budget; CUDA: a
fraction of the free memory after the model is loaded, like vLLM's gpu_memory_utilization).
"""

from __future__ import annotations

import torch


def block_bytes(n_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    return 2 * n_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def cuda_budget(device: torch.device, utilization: float) -> int:
    """Bytes for the KV pool on `device`: `utilization` of the total memory minus what is in use now."""
    free, total = torch.cuda.mem_get_info(device)
    return int(free - total * (1 - utilization))


def blocks_for_budget(budget_bytes: int, per_block: int) -> int:
    """Whole blocks that fit in `budget_bytes` (at least 0)."""
    return max(budget_bytes // per_block, 0)


class KVPool:
    """Per-layer key and value block tensors (plus one scratch block)."""

    def __init__(self, n_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, first_layer: int = 0):
        self.num_blocks, self.block_size, self.first_layer = num_blocks, block_size, first_layer
        shape = (n_layers, num_blocks + 1, block_size, kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value blocks of model layer `layer_idx` (a pipeline stage's pool starts at first_layer)."""
        i = layer_idx - self.first_layer
        return self.keys[i], self.values[i]
