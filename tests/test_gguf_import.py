"""GGUF import without downloads: a tiny random Llama written as a float32 GGUF the way llama.cpp lays it out.

llama.cpp's converter permutes each head's q/k rows into interleaved rotary pairs; the file written here
does the same, so fourfold's import must undo it for its logits to equal the Hugging Face model's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fourfold.checkpoint.gguf_import import import_gguf
from fourfold.checkpoint.store import load_checkpoint
from fourfold.config import build_config
from fourfold.errors import ConfigError
from fourfold.models.llama import Llama

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

HEADS, KV_HEADS = 4, 2
NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's HF converter gives q/k: per head, the two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: LlamaForCausalLM, path, arch: str = "llama") -> None:
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    for name, t in model.state_dict().items():
        w = t.float().numpy().copy()
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", w)
        elif name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", w)
        elif name == "lm_head.weight":
            writer.add_tensor("output.weight", w)
        else:
            stem, kind = name.rsplit(".", 1)  # model.layers.<i>.<module>, weight
            i, module = stem.split(".", 3)[2:]
            if module.endswith("q_proj"):
                w = llama_cpp_permute(w, HEADS)
            elif module.endswith("k_proj"):
                w = llama_cpp_permute(w, KV_HEADS)
            writer.add_tensor(f"blk.{i}.{NAMES[module]}.{kind}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                        max_position_embeddings=64, rms_norm_eps=1e-5)).float().eval()


def test_gguf_import_undoes_the_qk_permutation(tmp_path, tiny):
    write_gguf(tiny, tmp_path / "tiny.gguf")
    ckpt = import_gguf(tmp_path / "tiny.gguf", tmp_path / "ff")
    model = Llama(build_config(json.loads((ckpt / "meta.json").read_text())["config"]).model)
    load_checkpoint(ckpt, model)
    ids = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), tiny(ids).logits, atol=1e-5, rtol=1e-5)


def test_other_gguf_architectures_are_named(tmp_path, tiny):
    write_gguf(tiny, tmp_path / "tiny.gguf", arch="qwen2")
    with pytest.raises(ConfigError, match="qwen2"):
        import_gguf(tmp_path / "tiny.gguf", tmp_path / "ff")
