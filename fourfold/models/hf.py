"""Hugging Face Llama <-> fourfold: the parameter-name map and the config map, as data and two pure functions each.

    model_section = config_from_hf(json.load(open("config.json")))   # ConfigError if unsupported
    hf_config = config_to_hf(cfg.model)
    hf_name("layers.0.attention.wq.weight") == "model.layers.0.self_attn.q_proj.weight"

fourfold's Llama uses Hugging Face's rotary layout (rotate-half) and `[out, in]` linear weights, so
weights move between the two by renaming alone: no q/k permutation is needed here (GGUF files, which
llama.cpp permutes to the interleaved layout, are un-permuted in fourfold.checkpoint.gguf_import).
"""

from __future__ import annotations

import re

from fourfold.config import ModelConfig
from fourfold.errors import ConfigError

# fourfold name pattern -> Hugging Face name pattern; {i} is the block index, {p} weight or bias.
BLOCK_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
OUTER_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_FROM_HF_BLOCK = {v: k for k, v in BLOCK_NAMES.items()}
_FROM_HF_OUTER = {v: k for k, v in OUTER_NAMES.items()}

SUPPORTED_ROPE_TYPES = ("default", "llama3")
# Config keys that mean an architecture fourfold's Llama does not implement, and what to call it.
UNSUPPORTED_KEYS = {
    "num_local_experts": "mixture-of-experts layers (num_local_experts)",
    "num_experts": "mixture-of-experts layers (num_experts)",
    "n_routed_experts": "mixture-of-experts layers (n_routed_experts)",
    "moe_intermediate_size": "mixture-of-experts layers (moe_intermediate_size)",
    "sliding_window": "sliding-window attention (sliding_window)",
    "use_sliding_window": "sliding-window attention (use_sliding_window)",
    "layer_types": "per-layer attention types (layer_types)",
    "qk_norm": "q/k normalisation (qk_norm)",
    "use_qk_norm": "q/k normalisation (use_qk_norm)",
}


def hf_name(name: str) -> str:
    """The Hugging Face LlamaForCausalLM parameter name of fourfold parameter `name`."""
    if name in OUTER_NAMES:
        return OUTER_NAMES[name]
    m = _BLOCK.match(name)
    if m is None or m.group(2) not in BLOCK_NAMES:
        raise KeyError(f"fourfold parameter '{name}' has no Hugging Face name")
    return f"model.layers.{m.group(1)}.{BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def fourfold_name(name: str) -> str:
    """The fourfold parameter name of Hugging Face LlamaForCausalLM parameter `name`."""
    if name in _FROM_HF_OUTER:
        return _FROM_HF_OUTER[name]
    m = _HF_BLOCK.match(name)
    if m is None or m.group(2) not in _FROM_HF_BLOCK:
        raise KeyError(f"Hugging Face parameter '{name}' has no fourfold name")
    return f"layers.{m.group(1)}.{_FROM_HF_BLOCK[m.group(2)]}.{m.group(3)}"


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, fourfold rope_scaling) from either transformers 4 (`rope_scaling`) or 5 (`rope_parameters`)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"This model uses rope type '{rope_type}', which fourfold does not implement (supported: "
                          f"{', '.join(SUPPORTED_ROPE_TYPES)}); it cannot be imported.")
    if rope_type == "default":
        return theta, None
    try:
        scaling = {"factor": float(params["factor"]), "low_freq_factor": float(params["low_freq_factor"]),
                   "high_freq_factor": float(params["high_freq_factor"]),
                   "original_max_seq_len": int(params["original_max_position_embeddings"])}
    except KeyError as e:
        raise ConfigError(f"The llama3 rope scaling of this model lacks {e}; config.json is incomplete.") from None
    return theta, scaling


def config_from_hf(hf: dict) -> dict:
    """The fourfold [model] section (a dict) for a Hugging Face Llama config.json; ConfigError if unsupported."""
    model_type = hf.get("model_type")
    if model_type != "llama":
        raise ConfigError(f"model_type '{model_type}' is not supported: fourfold imports Llama-architecture models "
                          "(model_type 'llama', LlamaForCausalLM) only.")
    unsupported = [what for key, what in UNSUPPORTED_KEYS.items() if hf.get(key) not in (None, False, 0, [])]
    if hf.get("hidden_act", "silu") != "silu":
        unsupported.append(f"activation {hf['hidden_act']} (fourfold's MLP is SwiGLU with silu)")
    if unsupported:
        raise ConfigError(f"This model uses {'; '.join(unsupported)}, which fourfold's Llama does not implement; "
                          "it cannot be imported.")
    theta, scaling = _rope(hf)
    dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or dim // heads)
    return {
        "dim": dim,
        "n_layers": int(hf["num_hidden_layers"]),
        "n_heads": heads,
        "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "ffn_dim": int(hf["intermediate_size"]),
        "vocab_size": int(hf["vocab_size"]),
        "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "init_std": float(hf.get("initializer_range", 0.02)),
        "head_size": 0 if head_dim * heads == dim else head_dim,
        "attention_bias": bool(hf.get("attention_bias", False)),
        "mlp_bias": bool(hf.get("mlp_bias", False)),
    }


def config_to_hf(m: ModelConfig, dtype: str = "float32", special_ids: dict | None = None) -> dict:
    """A Hugging Face LlamaForCausalLM config.json (as a dict) for fourfold model config `m`.

    `special_ids` may carry bos_token_id / eos_token_id / pad_token_id from the tokenizer.
    """
    rope: dict = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling:
        s = m.rope_scaling
        rope = {"rope_type": "llama3", "factor": s["factor"], "low_freq_factor": s["low_freq_factor"],
                "high_freq_factor": s["high_freq_factor"], "original_max_position_embeddings": s["original_max_seq_len"],
                "rope_theta": m.rope_theta}
    legacy_scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if m.rope_scaling else None
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": m.dim,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "intermediate_size": m.ffn_dim,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": legacy_scaling,  # transformers 4 reads these two, transformers 5 rope_parameters
        "rope_parameters": rope,
        "tie_word_embeddings": m.tie_embeddings,
        "attention_bias": m.attention_bias,
        "attention_dropout": 0.0,
        "mlp_bias": m.mlp_bias,
        "initializer_range": m.init_std,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": dtype,
        **(special_ids or {}),
    }
