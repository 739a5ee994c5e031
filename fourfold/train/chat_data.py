"""Chat and instruction data: JSONL records -> token ids with a loss mask -> one padded sequence per record.

    template = chat_template_for(cfg.data)                  # data.chat_template: auto, default or a path
    train_set, val_set = chat_sequences(cfg.data, cfg.train.seq_len, tokenizer, template, is_writer)
    inputs, targets = train_set.pair(i)                     # (seq_len,) each; targets IGNORE_INDEX where no loss

A JSONL file holds one record per line, either a conversation `{"messages": [{"role", "content"}, ...]}`
or a plain document `{"text": "..."}`; blank lines are skipped, and anything else is a ConfigError naming
the file and the line. A conversation is rendered with the chat template and only its assistant turns
are trained: each turn's content and its end-of-turn marker (`ChatTemplate.render_with_spans`), never
the system or user turns nor the generation-prompt header. The rendered text is tokenized whole, as
transformers' `apply_chat_template` does, and each span's characters are mapped to tokens by encoding
the text before its start and end (`encode_record`). A `{"text"}` record trains every token (plus eos).

Sequences: one record per sequence of train.seq_len + 1 tokens, padded at the end with the tokenizer's
eos id (0 without one) and IGNORE_INDEX targets. Under the causal mask a token never sees the padding
after it and no sequence holds two records, so no record attends to another in any layout (context
parallel's ring and pipeline stages included) and padding adds nothing to the loss. A record longer than
seq_len + 1 tokens is cut to its first seq_len + 1 (counted, with a warning); one left with no trained
target is dropped (counted). The last `data.val_fraction` of the records are the validation split.

The tokenized records are cached like text corpora: `data.cache_dir/<key>/` with tokens.bin, trained.bin
(one byte per token, 1 = trained), bounds.bin (int64 record offsets) and meta.json, written last.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from pathlib import Path

import numpy as np
import torch

from fourfold.chat import ChatTemplate, check_messages
from fourfold.config import DataConfig
from fourfold.errors import ConfigError
from fourfold.ops.cross_entropy import IGNORE_INDEX
from fourfold.train.cache_files import write_atomic

CACHE_VERSION = "chat-v1"


def chat_template_for(data_cfg: DataConfig) -> ChatTemplate:
    """The template data.chat_template names: auto (beside a tokenizer.json, else the default), default, or a path.

    A path is a directory holding tokenizer_config.json, a tokenizer_config.json (any .json) file, or a
    plain Jinja template file.
    """
    spec = data_cfg.chat_template
    if spec == "default":
        return ChatTemplate()
    if spec == "auto":
        if data_cfg.tokenizer == "byte":
            return ChatTemplate()
        return ChatTemplate.for_model_dir(Path(data_cfg.tokenizer).parent)
    path = Path(spec)
    if path.is_dir():
        if not (path / "tokenizer_config.json").is_file():
            raise ConfigError(f"data.chat_template '{spec}' is a directory without tokenizer_config.json; point it "
                              "at a model directory that has one, a tokenizer_config.json or .jinja file, or use "
                              "'auto' or 'default'.")
        return ChatTemplate.for_model_dir(path)
    if path.is_file():
        return ChatTemplate.from_config_file(path) if path.suffix == ".json" else ChatTemplate.from_jinja_file(path)
    raise ConfigError(f"data.chat_template '{spec}' is neither 'auto', 'default' nor an existing file or directory; "
                      "give a model directory with tokenizer_config.json, such a file, or a .jinja template.")


def _record_error(file: Path, line: int, problem: str) -> ConfigError:
    return ConfigError(f"{file}:{line}: {problem} Each line of a chat JSONL file must be "
                       '{"messages": [{"role": ..., "content": ...}, ...]} or {"text": ...}.')


def parse_record(raw: str, file: Path, line: int) -> dict | None:
    """One JSONL line as a checked record ({"messages": [...]} or {"text": str}); None for a blank line."""
    if not raw.strip():
        return None
    try:
        record = json.loads(raw)
    except ValueError as e:
        raise _record_error(file, line, f"not valid JSON ({e}).") from None
    if not isinstance(record, dict) or ("messages" in record) == ("text" in record):
        raise _record_error(file, line, "the record needs exactly one of the keys 'messages' and 'text'.")
    if "text" in record:
        if not isinstance(record["text"], str):
            raise _record_error(file, line, f"'text' must be a string, got {type(record['text']).__name__}.")
        return {"text": record["text"]}
    messages = record["messages"]
    try:
        check_messages(messages)
    except ConfigError as e:
        raise _record_error(file, line, str(e)) from None
    if not any(m["role"] == "assistant" for m in messages):
        raise _record_error(file, line, "the conversation has no assistant message, so nothing in it would be "
                                        "trained.")
    return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}


def read_records(files: list[Path]) -> list[dict]:
    """Every record of the JSONL files, in order; ConfigError naming file and line for a bad one."""
    records = []
    for file in files:
        try:
            lines = Path(file).read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise ConfigError(f"{file} is not UTF-8 text ({e}); chat JSONL files must be UTF-8.") from None
        for number, raw in enumerate(lines, start=1):
            record = parse_record(raw, Path(file), number)
            if record is not None:
                records.append(record)
    if not records:
        raise ConfigError(f"The chat data files ({', '.join(str(f) for f in files[:3])}) hold no records.")
    return records


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def encode_record(record: dict, tokenizer, template: ChatTemplate) -> tuple[list[int], list[bool]]:
    """(token ids, trained flag per token) of one record: assistant spans trained, the rest not; text all trained.

    The rendered conversation is tokenized whole (the ids `apply_chat_template` gives). A span boundary
    at character b falls after the tokens that the text before b encodes to (their common prefix with the
    whole encoding), so a token straddling a span's start is trained and one straddling its end is not.
    """
    if "text" in record:
        ids = tokenizer.encode(record["text"]) + ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
        return ids, [True] * len(ids)
    text, spans = template.render_with_spans(record["messages"])
    ids = tokenizer.encode(text)
    trained = [False] * len(ids)
    for start, end in spans:
        first = _common_prefix(tokenizer.encode(text[:start]), ids)
        stop = _common_prefix(tokenizer.encode(text[:end]), ids) if end < len(text) else len(ids)
        trained[first:stop] = [True] * max(0, stop - first)
    return ids, trained


def chat_cache_folder(data_cfg: DataConfig, files: list[Path], tokenizer, template: ChatTemplate) -> Path:
    """The cache folder for these files, tokenizer and template (their content is the key)."""
    h = hashlib.sha256(CACHE_VERSION.encode())
    for f in files:
        h.update(hashlib.sha256(Path(f).read_bytes()).digest())
    h.update(f"|{tokenizer.name}|{template.source}|{template.bos_token}|{template.eos_token}".encode())
    return Path(data_cfg.cache_dir) / h.hexdigest()[:20]


def build_chat_cache(folder: Path, files: list[Path], tokenizer, template: ChatTemplate) -> None:
    """Tokenize every record into `folder` (tokens.bin, trained.bin, bounds.bin, then meta.json)."""
    dtype = np.uint16 if tokenizer.vocab_size < 2**16 else np.uint32
    ids_parts, trained_parts, bounds = [], [], [0]
    for record in read_records(files):
        ids, trained = encode_record(record, tokenizer, template)
        ids_parts.append(np.asarray(ids, dtype=dtype))
        trained_parts.append(np.asarray(trained, dtype=np.uint8))
        bounds.append(bounds[-1] + len(ids))
    folder.mkdir(parents=True, exist_ok=True)
    tokens = np.concatenate(ids_parts)
    write_atomic(folder / "tokens.bin", tokens.tobytes())
    write_atomic(folder / "trained.bin", np.concatenate(trained_parts).tobytes())
    write_atomic(folder / "bounds.bin", np.asarray(bounds, dtype=np.int64).tobytes())
    meta = {"dtype": str(tokens.dtype), "records": len(bounds) - 1, "n_tokens": int(tokens.size),
            "tokenizer": tokenizer.name, "format": CACHE_VERSION}
    write_atomic(folder / "meta.json", json.dumps(meta).encode())  # last: marks the cache complete


class ChatSequences:
    """One record per sequence, padded to seq_len + 1 tokens; the last val_fraction of the records are validation."""

    def __init__(self, folder: Path, seq_len: int, split: str, val_fraction: float, pad_id: int):
        meta_path = Path(folder) / "meta.json"
        if not meta_path.is_file():
            raise ConfigError(f"Chat data cache {folder} is missing or incomplete (no meta.json); delete it and run "
                              "again (in a distributed run the writer rank builds it before a barrier).")
        meta = json.loads(meta_path.read_text())
        self.tokens = np.fromfile(Path(folder) / "tokens.bin", dtype=np.dtype(meta["dtype"]))
        self.trained = np.fromfile(Path(folder) / "trained.bin", dtype=np.uint8)
        bounds = np.fromfile(Path(folder) / "bounds.bin", dtype=np.int64)
        self.seq_len, self.pad_id = seq_len, pad_id
        n = len(bounds) - 1
        n_val = math.ceil(val_fraction * n) if val_fraction > 0 else 0
        if n - n_val < 1:
            raise ConfigError(f"The chat data has {n} records; training needs at least one more than the "
                              f"{n_val} held out for validation. Add records or lower data.val_fraction.")
        chosen = range(n - n_val, n) if split == "val" else range(n - n_val)
        self.rows: list[tuple[int, int]] = []  # (start, length) of each kept record
        self.truncated = self.dropped = 0
        for r in chosen:
            start, length = int(bounds[r]), int(bounds[r + 1] - bounds[r])
            if length > seq_len + 1:
                self.truncated += 1
                length = seq_len + 1
            if not self.trained[start + 1:start + length].any():
                self.dropped += 1  # nothing left to learn from (targets are tokens 1 .. length-1)
                continue
            self.rows.append((start, length))
        if split == "train" and not self.rows:
            raise ConfigError(f"Every training record lost its trained tokens to truncation at train.seq_len="
                              f"{seq_len}; raise train.seq_len.")

    def __len__(self) -> int:
        return len(self.rows)

    def pair(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of record i, each (seq_len,): inputs padded with pad_id, targets IGNORE_INDEX
        at untrained and padded positions."""
        start, length = self.rows[i]
        ids = torch.from_numpy(self.tokens[start:start + length].astype(np.int64))
        trained = torch.from_numpy(self.trained[start + 1:start + length].astype(bool))
        inputs = torch.full((self.seq_len,), self.pad_id, dtype=torch.int64)
        targets = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.int64)
        inputs[:length - 1] = ids[:-1]
        targets[:length - 1] = torch.where(trained, ids[1:], IGNORE_INDEX)
        return inputs, targets


def chat_sequences(data_cfg: DataConfig, files: list[Path], seq_len: int, tokenizer, template: ChatTemplate,
                   is_writer: bool) -> tuple[ChatSequences, ChatSequences]:
    """(train, validation) sequences of the JSONL `files`, tokenizing them into the cache if `is_writer`.

    The writer warns once about truncated and dropped records; other ranks call this after a barrier.
    """
    folder = chat_cache_folder(data_cfg, files, tokenizer, template)
    if is_writer and not (folder / "meta.json").is_file():
        build_chat_cache(folder, files, tokenizer, template)
    pad_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    train = ChatSequences(folder, seq_len, "train", data_cfg.val_fraction, pad_id)
    val = ChatSequences(folder, seq_len, "val", data_cfg.val_fraction, pad_id)
    truncated, dropped = train.truncated + val.truncated, train.dropped + val.dropped
    if is_writer and (truncated or dropped):
        warnings.warn(f"chat data: {truncated} record(s) longer than train.seq_len + 1 = {seq_len + 1} tokens were "
                      f"cut to their first {seq_len + 1} tokens; {dropped} record(s) left with no assistant token to "
                      "train were dropped. Raise train.seq_len to keep them whole.", stacklevel=2)
    return train, val
