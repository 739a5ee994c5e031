"""Tokenizers: a byte-level one that needs no files (the default) and any Hugging Face tokenizer.json.

    tok = load_tokenizer("byte")            # or "path/to/tokenizer.json"
    ids = tok.encode("def f(): pass"); text = tok.decode(ids)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from fourfold.errors import ConfigError


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; id 256 ends a document."""

    vocab_size = 257
    eos_id = 256
    name = "byte"

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text` as ids; no eos is added."""
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` applied to each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        """Text from byte ids; ids >= 256 (eos) are skipped and invalid UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


EOS_CANDIDATES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|eot_id|>")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a tokenizer.json file."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        self.path = Path(path)
        data = self.path.read_bytes()
        self._tok = Tokenizer.from_str(data.decode("utf-8"))
        self.vocab_size = self._tok.get_vocab_size()
        vocab = self._tok.get_vocab()
        self.eos_id = next((vocab[t] for t in EOS_CANDIDATES if t in vocab), None)
        self.name = f"hf-{hashlib.sha256(data).hexdigest()[:16]}"

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without the tokenizer's special-token template (no bos/eos)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel by the Rust library."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """Text from token ids (special tokens skipped)."""
        return self._tok.decode(ids)


def load_tokenizer(spec: str):
    """'byte' -> ByteTokenizer; otherwise the path of a Hugging Face tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise ConfigError(f"data.tokenizer '{spec}' is neither 'byte' nor an existing tokenizer.json file; "
                          "pass --data.tokenizer byte or the path of a Hugging Face tokenizer.json.")
    try:
        return HFTokenizer(path)
    except Exception as e:  # tokenizers raises its own exception types for malformed files
        raise ConfigError(f"data.tokenizer '{spec}' could not be read as a Hugging Face tokenizer.json ({e}); "
                          "data.tokenizer takes 'byte' or the path of a valid tokenizer.json.") from None
