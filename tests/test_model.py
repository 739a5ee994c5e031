"""The Llama model: shapes, grouped-query attention, rotary embeddings, Hugging Face parity, overfitting."""

import math

import pytest
import torch
import torch.nn.functional as F

from fourfold.config import build_config
from fourfold.models.init import fill_initial, rows_per_block
from fourfold.models.llama import (Llama, apply_rotary, parameter_counts, rotary_frequencies, rotary_tables,
                                   training_flops_per_token)


def small_cfg(**model):
    base = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=32)
    base.update(model)
    return build_config({"model": base, "train": {"seq_len": 16}}).model


def test_shapes_and_parameter_count():
    cfg = small_cfg()
    model = Llama(cfg)
    logits = model(torch.randint(0, 64, (3, 16)))
    assert logits.shape == (3, 16, 64)
    total, non_emb = parameter_counts(cfg)
    assert total == sum(p.numel() for p in model.parameters())
    assert non_emb == total - model.tok_embeddings.weight.numel()


def test_tinyllama_preset_has_published_size():
    cfg = build_config({}, {"model.preset": "llama-1b"}).model
    total, _ = parameter_counts(cfg)
    assert abs(total - 1.1e9) / 1.1e9 < 0.01
    assert training_flops_per_token(cfg, 2048) > 6 * 1.0e9


def test_gqa_equals_mha_with_repeated_kv_heads():
    torch.manual_seed(0)
    gqa = Llama(small_cfg(n_kv_heads=2)).double()
    mha = Llama(small_cfg(n_kv_heads=4)).double()
    state = gqa.state_dict()
    for k, v in list(state.items()):
        if k.endswith(("wk.weight", "wv.weight")):
            hd = 32 // 4
            state[k] = v.view(2, hd, 32).repeat_interleave(2, dim=0).reshape(4 * hd, 32)
    mha.load_state_dict(state)
    x = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-12, atol=1e-12)


def test_attention_matches_explicit_causal_softmax():
    torch.manual_seed(0)
    cfg = small_cfg(n_kv_heads=4)
    attn = Llama(cfg).double().layers["0"].attention
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    cos, sin = (t.double() for t in rotary_tables(cfg))
    cos, sin = cos[:16], sin[:16]
    q = apply_rotary(attn.wq(x).view(2, 16, 4, 8), cos, sin).transpose(1, 2)
    k = apply_rotary(attn.wk(x).view(2, 16, 4, 8), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(2, 16, 4, 8).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    expected = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 16, 32))
    torch.testing.assert_close(attn(x, cos, sin), expected, rtol=1e-10, atol=1e-12)


def test_rotary_preserves_norm_and_depends_on_relative_position():
    cfg = small_cfg()
    cos, sin = (t.double() for t in rotary_tables(cfg))
    q = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 8, dtype=torch.float64)

    def at(x, pos):
        return apply_rotary(x, cos[pos:pos + 1], sin[pos:pos + 1])

    assert torch.allclose(at(q, 7).norm(), q.norm())
    dot = lambda m, n: (at(q, m) * at(k, n)).sum()  # noqa: E731
    assert torch.allclose(dot(5, 2), dot(13, 10))
    assert torch.allclose(dot(9, 9), (q * k).sum())
    assert not torch.allclose(dot(5, 2), dot(5, 3))


def test_llama3_frequency_scaling_keeps_high_and_slows_low_frequencies():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_seq_len": 8192}
    plain = rotary_frequencies(128, 500000.0)
    scaled = rotary_frequencies(128, 500000.0, scaling)
    assert torch.allclose(scaled[0], plain[0])  # shortest wavelength untouched
    assert torch.allclose(scaled[-1], plain[-1] / 8.0)  # longest slowed by the factor
    assert torch.all(scaled <= plain + 1e-15)


HF_BLOCK_NAMES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                  "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                  "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
                  "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
                  "ffn_norm": "post_attention_layernorm"}


def hugging_face_twin(ours: Llama):
    """A transformers LlamaForCausalLM with `ours`'s config and weights (same dtype), in eval mode."""
    transformers = pytest.importorskip("transformers")
    cfg = ours.cfg
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    dtype = next(ours.parameters()).dtype
    hf = transformers.LlamaForCausalLM(hf_cfg).to(dtype).eval()
    hf_state = {}
    for k, v in ours.state_dict().items():
        if k.startswith("layers."):
            _, i, rest = k.split(".", 2)
            for a, b in HF_BLOCK_NAMES.items():
                rest = rest.replace(a, b)
            hf_state[f"model.layers.{i}.{rest}"] = v
        elif k == "tok_embeddings.weight":
            hf_state["model.embed_tokens.weight"] = v
        elif k == "norm.weight":
            hf_state["model.norm.weight"] = v
        elif k == "output.weight":
            hf_state["lm_head.weight"] = v
    missing, unexpected = hf.load_state_dict(hf_state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    return hf


def test_matches_hugging_face_llama():
    torch.manual_seed(0)
    ours = Llama(small_cfg()).double()
    hf = hugging_face_twin(ours)
    x = torch.randint(0, 64, (2, 16))
    # float64 weights; both models keep float32 rotary tables, hence 1e-7 rather than 1e-12.
    torch.testing.assert_close(ours(x), hf(x).logits, rtol=1e-6, atol=1e-7)


def test_initial_weights_depend_on_the_seed_and_the_name_only():
    cfg = small_cfg()
    torch.manual_seed(3)
    first = Llama(cfg)
    torch.manual_seed(3)
    again = Llama(cfg)
    other = Llama(small_cfg())
    other.init_weights(seed=4)
    params = dict(first.named_parameters())
    assert all(torch.equal(p, params[n]) for n, p in again.named_parameters())
    assert not torch.equal(other.layers["0"].attention.wq.weight, params["layers.0.attention.wq.weight"])
    # every matrix its own draw (not the same stream repeated), with the documented scales
    assert not torch.equal(params["layers.0.feed_forward.w1.weight"], params["layers.0.feed_forward.w3.weight"])
    assert torch.equal(params["layers.1.ffn_norm.weight"], torch.ones(32))
    wq, wo = params["layers.0.attention.wq.weight"], params["layers.0.attention.wo.weight"]
    assert abs(wq.std().item() - cfg.init_std) < 0.1 * cfg.init_std
    assert abs(wo.std().item() - cfg.init_std / math.sqrt(2 * cfg.n_layers)) < 0.1 * cfg.init_std


def test_any_block_of_a_parameter_is_the_same_slice_of_its_full_value():
    cfg = small_cfg()
    shape = (3000, 1024)  # three generated row blocks of 1024 rows
    assert rows_per_block(shape) == 1024
    full = torch.empty(shape)
    fill_initial(full, "output.weight", shape, cfg, 5, (0, 0))
    part = torch.empty(100, 24, dtype=torch.float64)  # crosses the first block boundary; any dtype
    fill_initial(part, "output.weight", shape, cfg, 5, (1000, 512))
    assert torch.equal(part, full[1000:1100, 512:536].double())
    assert abs(full.std().item() - cfg.init_std) < 0.01 * cfg.init_std


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    model = Llama(small_cfg())
    batch = torch.randint(0, 64, (4, 17))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(150):
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1))
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 3.5  # about ln(64) = 4.16 at initialisation
    assert loss.item() < 0.1
