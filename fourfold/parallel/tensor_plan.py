"""The tensor-parallel sharding plan as data: which module of the Llama model is split how.

Column-parallel linears split their output features (attention heads, MLP hidden units) across tp
ranks and need their input replicated; row-parallel linears split their input features and produce
partial sums (all-reduced, or reduce-scattered along the sequence under sequence parallel). The token
embedding is split by vocabulary rows, the output head by vocabulary columns, and its logits stay
sharded so the loss is computed vocab-parallel.

Under sequence parallel the residual stream between modules is a plain tensor holding this rank's
seq/tp positions (Shard(1) of the full activations): the embedding and every row-parallel linear
reduce-scatter into it, the norms (`SequenceParallel`) run on it with replicated weights, and
`PrepareModuleInput` all-gathers it when entering attention or the MLP. `Attention.forward(x, cos,
sin)` and `TransformerBlock.forward(x, cos, sin)` take the rotary tables too: those are plain,
full-sequence tensors, so their layouts are `None` (left untouched), and the block itself needs no
input preparation because its `x` is already the sequence shard. The inference arguments (`cache`,
`layer_idx`) reach the attention by keyword, which the plan's positional layouts leave alone; a
cache sees each rank's own heads.

    plan = {**outer_plan(sp, has_embedding=True, has_head=True)}   # applied to the Llama
    block_plan(sp)                                                  # applied to each block
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

SEQ_DIM = 1  # activations are (batch, seq, dim)


def residual_layout(sequence_parallel: bool):
    """How the residual stream between blocks is laid out across tp ranks."""
    return Shard(SEQ_DIM) if sequence_parallel else Replicate()


def outer_plan(sequence_parallel: bool, has_embedding: bool, has_head: bool) -> dict:
    """Embedding, final norm and head (whichever this model or pipeline chunk holds)."""
    residual = residual_layout(sequence_parallel)
    plan = {}
    if has_embedding:
        # Tokens replicated; each rank looks up its vocabulary rows (zeros elsewhere), and the partial
        # sums are all-reduced (or reduce-scattered along the sequence) into the residual stream.
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if has_head:
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        # Logits stay a vocab-sharded DTensor: loss_parallel consumes them without an all-gather.
        plan["output"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    return plan


def block_plan(sequence_parallel: bool) -> dict:
    """One transformer block: q/k/v and w1/w3 column-parallel, wo and w2 row-parallel."""
    residual = residual_layout(sequence_parallel)
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
        plan["attention"] = PrepareModuleInput(input_layouts=(Shard(SEQ_DIM), None, None),
                                               desired_input_layouts=(Replicate(), None, None))
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(SEQ_DIM),),
                                                  desired_input_layouts=(Replicate(),))
    return plan
