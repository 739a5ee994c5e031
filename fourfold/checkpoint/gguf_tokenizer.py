"""Rebuild a GGUF file's tokenizer as Hugging Face files: tokenizer.json, tokenizer_config.json, generation_config.json.

GGUF stores a "gpt2" tokenizer as metadata: `tokenizer.ggml.tokens` (the vocabulary, in byte-level
characters), `tokenizer.ggml.merges` ("a b" strings, highest priority first), `tokenizer.ggml.token_type`
(1 normal, 3 control, 4 user-defined, ...), the special token ids and `tokenizer.chat_template`. The
`tokenizers` library builds the same byte-level BPE from those; `tokenizer.ggml.pre` names the
pre-tokenizer ("smollm" splits digits one by one before the byte-level split).
"""

from __future__ import annotations

import json

from fourfold.errors import ConfigError

CONTROL, USER_DEFINED = 3, 4
SPLIT_DIGITS = ("smollm",)  # pre-tokenizers that put each digit in its own piece


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def build_tokenizer(reader):
    """A `tokenizers.Tokenizer` for the GGUF file's gpt2-style BPE; ConfigError for other tokenizer models."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(f"The GGUF tokenizer model '{kind}' is not supported; fourfold rebuilds 'gpt2' (byte-level "
                          "BPE) tokenizers only.")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=bool(_field(reader, "tokenizer.ggml.add_space_prefix", 0)),
                                          use_regex=True)
    if _field(reader, "tokenizer.ggml.pre") in SPLIT_DIGITS:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, t in enumerate(types) if t == CONTROL])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i, t in enumerate(types) if t == USER_DEFINED])
    return tokenizer


def tokenizer_files(reader, max_len: int) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json (chat template, bos/eos) and generation_config.json; {} without a vocabulary."""
    if _field(reader, "tokenizer.ggml.tokens") is None:
        return {}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    ids = {name: _field(reader, f"tokenizer.ggml.{name}_token_id")
           for name in ("bos", "eos", "unknown", "padding")}
    text = {name: tokens[i] if i is not None and 0 <= i < len(tokens) else None for name, i in ids.items()}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text["bos"], "eos_token": text["eos"], "unk_token": text["unknown"], "pad_token": text["padding"],
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", 0)),
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    generation = {k: v for k, v in (("bos_token_id", ids["bos"]), ("eos_token_id", ids["eos"]),
                                    ("pad_token_id", ids["padding"])) if v is not None}
    return {
        "tokenizer.json": build_tokenizer(reader).to_str(pretty=False).encode(),
        "tokenizer_config.json": json.dumps({k: v for k, v in config.items() if v is not None}, indent=1).encode(),
        "generation_config.json": json.dumps({k: int(v) for k, v in generation.items()}, indent=1).encode(),
    }
