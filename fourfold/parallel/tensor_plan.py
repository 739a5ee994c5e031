"""The tensor-parallel sharding plan as data: which module of the Llama model is split how.

Column-parallel linears split their output features (attention heads, MLP hidden units) across tp
ranks and need their input replicated; row-parallel linears split their input features and produce
partial sums (all-reduced, or reduce-scattered along the sequence under sequence parallel). The token
embedding is split by vocabulary rows, the output head by vocabulary columns, and its logits stay
sharded so the loss is computed vocab-parallel.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)


def outer_plan(sequence_parallel: bool, has_embedding: bool, has_head: bool) -> dict:
    """Embedding, final norm and head (whichever this model or pipeline chunk holds)."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {}
    if has_embedding:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if has_head:
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    return plan


def block_plan(sequence_parallel: bool) -> dict:
    """One transformer block: q/k/v and w1/w3 column-parallel, wo and w2 row-parallel."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=residual),
    }
    if sequence_parallel:
        # Norms run on sequence shards; the all-gather happens when entering attention / the MLP.
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
        plan["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                               desired_input_layouts=(Replicate(), None, None))
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan
