"""The inference engine's settings: KV-cache size, block size, batching limits, prefix caching.

    cfg = EngineConfig(max_num_seqs=64, max_num_batched_tokens=1024, kv_cache_bytes=256 << 20)

The KV pool's size: `num_kv_blocks` when set; otherwise on CUDA `gpu_memory_utilization` of the GPU's
memory minus what is in use once the model is loaded, and on CPU `kv_cache_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fourfold.settings import setting


@dataclass
class EngineConfig:
    """How the engine batches requests and how much memory its KV cache takes."""

    block_size: int = setting(16, ge=1)
    """Tokens per KV-cache block."""
    num_kv_blocks: int = setting(0, ge=0)
    """Blocks in the KV pool; 0 sizes the pool from memory (gpu_memory_utilization or kv_cache_bytes)."""
    gpu_memory_utilization: float = setting(0.9, gt=0, le=1)
    """On CUDA: the fraction of the GPU's memory the model and the KV pool may use together."""
    kv_cache_bytes: int = setting(512 << 20, ge=1)
    """On CPU: bytes of the KV pool (keys and values of every layer)."""
    max_num_seqs: int = setting(256, ge=1)
    """Sequences running at once at most."""
    max_num_batched_tokens: int = setting(2048, ge=1)
    """Tokens per engine step at most (decodes first, then prefill chunks)."""
    max_model_len: int = setting(0, ge=0)
    """Context length, prompt plus generated tokens; 0 takes the model's max_seq_len."""
    enable_prefix_caching: bool = setting(True)
    """Reuse the KV blocks of identical prompt prefixes (hashed full blocks, LRU eviction)."""
    enable_chunked_prefill: bool = setting(True)
    """Split prompts into chunks that share steps with running decodes (Sarathi-Serve); off: prefill-first
    scheduling, whole prompts in steps of their own (the classic baseline)."""
    cuda_graphs: bool = setting(True)
    """On CUDA (with Triton): replay decode steps from CUDA graphs captured at padded batch sizes."""
    prefill_graph_tokens: int = setting(2048, ge=0)
    """With cuda_graphs, one-process models: steps with prefill tokens and at most this many tokens (a prompt or a
    chunk of one, alone or beside other sequences' decode tokens and chunks) replay CUDA graphs too, captured at
    padded token counts (fourfold.infer.prefill_graphs); 0: none."""
    prefill_graph_seqs: int = setting(0, ge=0)
    """Most sequences a step replayed from a prefill graph may hold (0: max_num_seqs; 1: a prompt or a chunk alone,
    so steps that mix one with decodes run eagerly)."""
    fused_decoder: bool = setting(True)
    """Run whole models with fused q|k|v and gate|up weights: fused Triton kernels on CUDA, the packed CPU step (cpu_decoder) on CPU."""
    overlap_steps: bool = setting(True)
    """On CUDA: build a step's outputs while the next step runs on the GPU (outputs come one step later)."""
    look_ahead: bool = setting(True)
    """With overlap_steps: launch the next decode step before the previous step's tokens are read back."""
    look_ahead_max_seqs: int = setting(256, ge=0)
    """Look ahead only while at most this many sequences run (0: never). It takes the same steps as the plain
    path at any batch (tests/test_engine_look_ahead.py); bench/engine_steps_gpu.py times both side by side."""
    freeze_gc: bool = setting(True)
    """On CUDA: once built, collect and freeze the objects that exist (gc.freeze) so later garbage-collector runs skip
    them; building the next engine undoes it first (fourfold.infer.gc_freeze)."""
    pipeline_micro_batching: bool = setting(True)
    """Pipeline-parallel ranks: split the requests into one micro-batch per stage so every stage works at once
    (fourfold.infer.pipeline_engine); off: one step in flight, the other stages idle while one computes."""
