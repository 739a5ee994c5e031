"""One forward for training and inference: per-token positions, logits for chosen tokens, the attention-cache seam."""

import torch
import torch.nn.functional as F

from fourfold.models.attention import AttentionCache
from fourfold.models.llama import Llama
from tests.test_model import small_cfg


def tiny_model() -> Llama:
    torch.manual_seed(0)
    return Llama(small_cfg()).double().eval()


class RecordingCache:
    """An attention cache without storage: causal attention over this step's tokens, noting each layer index."""

    def __init__(self):
        self.layers: list[int] = []

    def attend(self, layer_idx, q, k, v):
        self.layers.append(layer_idx)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_per_sequence_positions_rotate_each_row_by_its_own_positions():
    model = tiny_model()
    tokens = torch.randint(0, 64, (2, 8))
    default = model(tokens)
    torch.testing.assert_close(model(tokens, torch.arange(8).expand(2, 8)), default, rtol=0, atol=0)
    # Row 1 sits at every other position (a shift alone would not show: rotary attention sees only
    # relative positions); it must equal that row alone with the batch-wide vector 0, 2, ..., 14.
    ragged = torch.stack([torch.arange(8), torch.arange(0, 16, 2)])
    out = model(tokens, ragged)
    torch.testing.assert_close(out[0], default[0], rtol=0, atol=0)
    torch.testing.assert_close(out[1:], model(tokens[1:], torch.arange(0, 16, 2)), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out[1], default[1])


def test_logits_for_runs_the_head_on_chosen_tokens_only():
    model = tiny_model()
    tokens = torch.randint(0, 64, (3, 8))
    full = model(tokens)
    head_inputs = []
    model.output.register_forward_hook(lambda module, args, out: head_inputs.append(tuple(args[0].shape)))
    chosen = torch.tensor([7, 8 + 2, 8 + 7, 16 + 5])  # last of row 0, third and last of row 1, sixth of row 2
    logits = model(tokens, logits_for=chosen)
    assert logits.shape == (4, 64) and head_inputs == [(4, 32)]
    torch.testing.assert_close(logits, full.flatten(0, 1)[chosen], rtol=1e-12, atol=1e-12)


def test_attention_cache_gets_every_layer_index_and_replaces_the_core():
    model = tiny_model()
    tokens = torch.randint(0, 64, (2, 8))
    expected = model(tokens)

    def core_must_not_run(*args):
        raise AssertionError("the attention core ran although a cache was given")

    for block in model.layers.values():
        block.attention.core.forward = core_must_not_run
    cache = RecordingCache()
    assert isinstance(cache, AttentionCache)
    torch.testing.assert_close(model(tokens, cache=cache), expected, rtol=1e-12, atol=1e-12)
    assert cache.layers == [0, 1]


def test_pipeline_chunk_passes_global_layer_indices():
    model = tiny_model()
    del model.layers["0"]  # what a later pipeline stage holds: block "1" only
    model.tok_embeddings = None
    cache = RecordingCache()
    model(torch.randn(2, 8, 32, dtype=torch.float64), cache=cache)
    assert cache.layers == [1]


def test_training_path_calls_causal_sdpa_without_a_mask(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        calls.append(kwargs)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    tiny_model()(torch.randint(0, 64, (2, 8)))
    assert calls == [{"is_causal": True, "enable_gqa": True}] * 2


def test_block_compiles_as_one_graph_and_is_reused_across_blocks():
    model = tiny_model()
    x = torch.randn(2, 8, 32, dtype=torch.float64)
    cos, sin = model.rope_cos[:8], model.rope_sin[:8]
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for name, block in model.layers.items():
            compiled = torch.compile(block, fullgraph=True, backend="eager")
            # The layer index (unused without a cache) must not make each block compile again.
            torch.testing.assert_close(compiled(x, cos, sin, layer_idx=int(name)), block(x, cos, sin))
    torch._dynamo.reset()
