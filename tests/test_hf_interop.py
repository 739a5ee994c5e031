"""Hugging Face interop: a tiny random LlamaForCausalLM -> fourfold (same logits) -> Hugging Face (loads cleanly, same logits)."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch

from fourfold.checkpoint.hf_export import export_hf
from fourfold.checkpoint.hf_import import import_hf, own_tokenizer
from fourfold.checkpoint.store import load_checkpoint
from fourfold.config import build_config
from fourfold.errors import CheckpointError, ConfigError
from fourfold.models.hf import config_from_hf, fourfold_name, hf_name
from fourfold.models.llama import Llama

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0)
VARIANTS = {
    "mha": {},
    "gqa": {"num_key_value_heads": 2},
    "tied": {"tie_word_embeddings": True, "num_key_value_heads": 2},
    "llama3_rope": {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                             "original_max_position_embeddings": 16}},
    "head_dim": {"head_dim": 24, "num_key_value_heads": 2},
    "bias": {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 2},
}


def hf_model(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**BASE, **overrides})).float().eval()
    with torch.no_grad():  # transformers zero-initialises biases; random ones make the bias test able to fail
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def load_fourfold(ckpt) -> Llama:
    meta = json.loads((ckpt / "meta.json").read_text())
    cfg = build_config(meta["config"])
    model = Llama(cfg.model)
    load_checkpoint(ckpt, model)
    return model.eval()


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(1))


def load_quietly(path) -> LlamaForCausalLM:
    """from_pretrained, failing on any warning or log record about keys or weights."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = LlamaForCausalLM.from_pretrained(path, output_loading_info=True)
    finally:
        root.removeHandler(handler)
    model, info = model
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    messages = [r.getMessage() for r in records if r.levelno >= logging.WARNING] + [str(w.message) for w in caught]
    assert not [m for m in messages if "key" in m.lower() or "weight" in m.lower() or "initialized" in m.lower()], messages
    return model.float().eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trip_keeps_logits(tmp_path, variant):
    reference = hf_model(**VARIANTS[variant])
    reference.save_pretrained(tmp_path / "hf")
    ids = tokens(BASE["vocab_size"])
    with torch.no_grad():
        expected = reference(ids).logits

    ckpt = import_hf(tmp_path / "hf", tmp_path / "ff")
    model = load_fourfold(ckpt)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expected, atol=1e-5, rtol=1e-5)

    export_hf(ckpt, tmp_path / "back")
    again = load_quietly(tmp_path / "back")
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, expected, atol=1e-5, rtol=1e-5)
    assert again.config.tie_word_embeddings == reference.config.tie_word_embeddings


def test_sharded_index_and_tokenizer_files_are_imported(tmp_path):
    reference = hf_model(num_key_value_heads=2)
    reference.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ff")
    assert json.loads((ckpt / "tokenizer_config.json").read_text())["chat_template"] == "{{ messages }}"
    assert json.loads((ckpt / "meta.json").read_text())["config"]["data"]["tokenizer"] == str(
        (tmp_path / "ff" / "tokenizer.json").resolve())
    ids = tokens(BASE["vocab_size"])
    with torch.no_grad():
        torch.testing.assert_close(load_fourfold(ckpt)(ids), reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_names_map_both_ways():
    model = Llama(build_config({"model": {"attention_bias": True, "mlp_bias": True}}).model)
    for name in model.state_dict():
        assert fourfold_name(hf_name(name)) == name


@pytest.mark.parametrize("change, named", [
    ({"model_type": "mistral"}, "mistral"),
    ({"num_local_experts": 8}, "mixture-of-experts"),
    ({"sliding_window": 4096}, "sliding-window"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"hidden_act": "gelu"}, "gelu"),
])
def test_unsupported_architectures_are_named(change, named):
    config = {**LlamaConfig(**BASE).to_dict(), **change}
    config.pop("rope_parameters", None) if "rope_scaling" in change else None
    with pytest.raises(ConfigError, match=named):
        config_from_hf(config)


def test_weights_that_do_not_match_the_config_are_refused(tmp_path):
    hf_model().save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["intermediate_size"] = 100
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="wrong shape"):
        import_hf(tmp_path / "hf", tmp_path / "ff")
    assert not (tmp_path / "ff").exists()


def test_separate_chat_template_file_is_folded_into_tokenizer_config(tmp_path):
    hf_model().save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ff")
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert config["chat_template"] == "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_transformers_4_rope_fields_are_read():
    """Older config.json files carry rope_theta and rope_scaling at the top level (no rope_parameters)."""
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
              "intermediate_size": 128, "vocab_size": 96, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}
    section = config_from_hf(config)
    assert section["rope_theta"] == 500000.0
    assert section["rope_scaling"] == {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_seq_len": 8192}


def test_moved_checkpoint_still_finds_its_own_tokenizer(tmp_path):
    hf_model().save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    import_hf(tmp_path / "hf", tmp_path / "ff")
    (tmp_path / "ff").rename(tmp_path / "moved")
    spec = json.loads((tmp_path / "moved" / "meta.json").read_text())["config"]["data"]["tokenizer"]
    assert own_tokenizer(tmp_path / "moved", spec) == str(tmp_path / "moved" / "tokenizer.json")
    assert own_tokenizer(tmp_path, "byte") == "byte"
