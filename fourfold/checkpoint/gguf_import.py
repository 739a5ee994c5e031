"""Import a llama.cpp GGUF file (Llama architecture) into a fourfold checkpoint directory, tokenizer included.

    import_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "models/smollm2")

Weights are dequantized to float32 with the `gguf` package (numpy), renamed to fourfold's names, and
q/k are un-permuted: llama.cpp stores each head's rotary pairs interleaved (x0, x1 = a pair), while
fourfold, like Hugging Face, rotates the two halves of the head. The tokenizer (a "gpt2" byte-level BPE:
vocabulary, merges, token types) is rebuilt as a `tokenizers` tokenizer.json (fourfold.checkpoint.
gguf_tokenizer); the chat template and special tokens go to tokenizer_config.json and
generation_config.json, as an imported Hugging Face directory has them.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from fourfold.checkpoint.gguf_tokenizer import tokenizer_files
from fourfold.checkpoint.hf_import import finish_tensors, run_config
from fourfold.checkpoint.consolidated import write_consolidated
from fourfold.errors import CheckpointError, ConfigError

OUTER = {"token_embd": "tok_embeddings", "output_norm": "norm", "output": "output"}
BLOCK = {"attn_q": "attention.wq", "attn_k": "attention.wk", "attn_v": "attention.wv", "attn_output": "attention.wo",
         "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
         "attn_norm": "attention_norm", "ffn_norm": "ffn_norm"}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_gguf(path: str | Path):
    """A gguf.GGUFReader of `path`; CheckpointError if the file cannot be parsed, ConfigError without `gguf`."""
    try:
        import gguf  # an optional dependency (the `real` extra): imported when a GGUF file is read
    except ImportError:
        raise ConfigError("Reading GGUF files needs the gguf package: pip install 'fourfold[real]' (or gguf).") from None
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/struct errors on damaged files
        raise CheckpointError(f"{path} is not a readable GGUF file ({e}).") from None


def field(reader, key: str, default=None):
    """The value of metadata field `key` (a scalar, string or list), or `default` when absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def model_section(reader) -> dict:
    """The fourfold [model] section from a GGUF file's llama.* metadata; ConfigError for what fourfold lacks."""
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ConfigError(f"GGUF architecture '{arch}' is not supported: fourfold imports Llama-architecture GGUF "
                          "files (general.architecture 'llama') only.")
    unsupported = []
    if field(reader, "llama.expert_count", 0):
        unsupported.append("mixture-of-experts layers (llama.expert_count)")
    if field(reader, "llama.rope.scaling.type", "none") not in ("none",):
        unsupported.append(f"rope scaling '{field(reader, 'llama.rope.scaling.type')}'")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        unsupported.append("rope frequency factors (rope_freqs.weight)")
    dim, heads = int(field(reader, "llama.embedding_length")), int(field(reader, "llama.attention.head_count"))
    head_dim = int(field(reader, "llama.attention.key_length", dim // heads))
    if int(field(reader, "llama.rope.dimension_count", head_dim)) != head_dim:
        unsupported.append("partial rotary embeddings (llama.rope.dimension_count < head size)")
    if unsupported:
        raise ConfigError(f"This GGUF model uses {'; '.join(unsupported)}, which fourfold's Llama does not implement; "
                          "it cannot be imported.")
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    tensor_names = {t.name for t in reader.tensors}
    return {
        "dim": dim,
        "n_layers": int(field(reader, "llama.block_count")),
        "n_heads": heads,
        "n_kv_heads": int(field(reader, "llama.attention.head_count_kv", heads)),
        "ffn_dim": int(field(reader, "llama.feed_forward_length")),
        "vocab_size": int(field(reader, "llama.vocab_size", len(tokens))),
        "max_seq_len": int(field(reader, "llama.context_length", 2048)),
        "rope_theta": float(field(reader, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "norm_eps": float(field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "tie_embeddings": "output.weight" not in tensor_names,
        "head_size": 0 if head_dim * heads == dim else head_dim,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
    }


def fourfold_name(name: str) -> str:
    """The fourfold parameter name of GGUF tensor `name`; KeyError if it has none."""
    stem, _, kind = name.rpartition(".")
    if stem in OUTER:
        return f"{OUTER[stem]}.{kind}"
    m = _BLOCK_NAME.match(name)
    if m is None or m.group(2) not in BLOCK:
        raise KeyError(name)
    return f"layers.{m.group(1)}.{BLOCK[m.group(2)]}.{m.group(3)}"


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows (pair 0 x, pair 0 y, pair 1 x, ...) -> (all x, all y)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantized(tensor) -> torch.Tensor:
    """A GGUF tensor as float32, shaped [out, in] (GGUF lists dimensions innermost first)."""
    import gguf  # optional dependency, see open_gguf

    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def read_gguf_tensors(reader, section: dict, source: str) -> dict[str, torch.Tensor]:
    """Every weight under its fourfold name, dequantized, q/k in fourfold's rotary layout."""
    heads = {"attn_q": section["n_heads"], "attn_k": section["n_kv_heads"]}  # the two permuted projections
    tensors, unknown = {}, []
    for tensor in reader.tensors:
        try:
            name = fourfold_name(tensor.name)
        except KeyError:
            unknown.append(tensor.name)
            continue
        value = dequantized(tensor)
        module = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""  # blk.<i>.<module>.weight
        tensors[name] = unpermute(value, heads[module]) if module in heads else value
    if unknown:
        raise CheckpointError(f"{source} holds tensors fourfold's Llama has no place for ({', '.join(unknown[:5])}); "
                              "the architecture is not plain Llama.")
    return tensors


def import_gguf(path: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Import the Llama GGUF file `path` as the fourfold checkpoint directory `out_dir` (float32 unless `dtype`)."""
    reader = open_gguf(path)
    section = model_section(reader)
    tensors = finish_tensors(read_gguf_tensors(reader, section, str(path)), section, str(path), dtype)
    extra = tokenizer_files(reader, section["max_seq_len"])
    out = Path(out_dir)
    return write_consolidated(out, run_config(section, out, "tokenizer.json" in extra), tensors, extra)
