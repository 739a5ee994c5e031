"""Training data: text sources -> a cached memory-mapped token file -> packed sequences -> per-rank batches.

Two formats (data.format): a text corpus, packed into windows of seq_len + 1 tokens (below), or chat
JSONL (fourfold/train/chat_data.py): one conversation or document per padded sequence, targets set to
IGNORE_INDEX where no loss is taken. Either way a dataset gives `pair(i)` -> (inputs, targets).

    tokenizer, train_batches, val_batches = build_data(cfg, data_rank, data_world, is_writer)
    micro_batches = train_batches.next_step()      # [(inputs, targets), ...] for this rank

The corpus is tokenized once into `data.cache_dir/<key>/tokens.bin` (uint16 or uint32), the key hashing
the bytes read, the tokenizer and the byte limit. In a distributed run one rank builds it
(`is_writer=True`), the caller puts a barrier, and then every rank maps it (`is_writer=False` only
computes the key and locates the file, so it must run after the barrier):

    if is_main: build_data(cfg, r, D, is_writer=True)
    barrier()
    tokenizer, batches, val = build_data(cfg, r, D, is_writer=False)

Batches: each optimizer step draws `global_batch` sequence indices from a seeded permutation; data rank
r of D takes the r-th contiguous slice and splits it into micro-batches. Concatenating every rank's
micro-batches in rank order gives exactly the single-process micro-batches, so every layout trains on
the same data. The sampler's position is saved in checkpoints.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import torch

from fourfold.config import Config, DataConfig
from fourfold.errors import ConfigError
from fourfold.layout import check_global_batch
from fourfold.tokenizer import ByteTokenizer, load_tokenizer
from fourfold.train.cache_files import write_atomic as _write_atomic
from fourfold.train.chat_data import chat_sequences, chat_template_for, read_records


def source_files(path: str | None) -> list[Path]:
    """The files a data path names (a file, a directory, or a glob); None -> the stdlib's .py sources."""
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        skip = {"site-packages", "dist-packages", "__pycache__"}
        files = sorted(p for p in root.rglob("*.py") if not skip.intersection(p.parts))
        if not files:
            raise ConfigError(f"No Python standard library sources under {root}; pass --data.path with text files.")
        return files
    p = Path(path)
    if p.is_file():
        if _looks_binary(p):
            raise ConfigError(f"data.path '{path}' is a binary file (a NUL byte in its first KiB), not text, so it "
                              "would be skipped and leave nothing to train on; point data.path at text files "
                              "(.txt, .py, .md, ...), or leave it unset to train on the Python standard library.")
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and not _looks_binary(f) and
                       not any(part.startswith(".") for part in f.relative_to(p).parts))
        if not files:
            raise ConfigError(f"data.path '{path}' is a directory with no text files in it (binary and hidden files "
                              "are skipped); point data.path at text files, or leave it unset to train on the "
                              "Python standard library.")
        return files
    matches = sorted(Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file())
    if not matches:
        what = "matches no files" if any(c in path for c in "*?[") else "does not exist"
        raise ConfigError(f"data.path '{path}' {what}; give a text file, a directory or a glob "
                          "(e.g. 'data/*.txt'), or leave it unset to train on the Python standard library.")
    files = [f for f in matches if not _looks_binary(f)]
    if not files:
        shown = ", ".join(str(f) for f in matches[:3]) + (f" and {len(matches) - 3} more" if len(matches) > 3 else "")
        raise ConfigError(f"data.path '{path}' matches only binary files ({shown}), which are skipped as not text; "
                          "point data.path at text files, or leave it unset to train on the Python standard library.")
    return files


def _looks_binary(path: Path) -> bool:
    """A file whose first KiB holds a NUL byte is treated as binary (images, archives, compiled files)."""
    with open(path, "rb") as f:
        return b"\0" in f.read(1024)


def _read_documents(files: list[Path], max_bytes: int) -> list[bytes]:
    """The raw bytes of each text file in order, stopping once max_bytes (0: no limit) have been read."""
    docs, total = [], 0
    for f in files:
        with open(f, "rb") as fh:
            raw = fh.read(max_bytes - total) if max_bytes else fh.read()
        if b"\0" in raw[:1024]:
            continue  # binary (source_files already leaves these out; a file may change after it looked)
        docs.append(raw)
        total += len(raw)
        if max_bytes and total >= max_bytes:
            break
    return docs


def _encode(docs: list[bytes], tokenizer) -> np.ndarray:
    """One flat token array: each document's ids followed by eos (when the tokenizer has one)."""
    dtype = np.uint16 if tokenizer.vocab_size < 2**16 else np.uint32
    eos = tokenizer.eos_id
    if isinstance(tokenizer, ByteTokenizer):
        parts = []
        for d in docs:  # invalid UTF-8 is normalised the same way ByteTokenizer.encode would see it
            text = d.decode("utf-8", errors="replace").encode("utf-8")
            parts.append(np.frombuffer(text, dtype=np.uint8).astype(dtype))
            parts.append(np.array([eos], dtype=dtype))
        return np.concatenate(parts) if parts else np.zeros(0, dtype)
    out = []
    for ids in tokenizer.encode_batch([d.decode("utf-8", errors="replace") for d in docs]):
        out.append(np.asarray(ids + ([eos] if eos is not None else []), dtype=dtype))
    return np.concatenate(out) if out else np.zeros(0, dtype)


def token_file(data_cfg: DataConfig, tokenizer, rank_is_writer: bool = True) -> Path:
    """Path of the cached token file for these sources and tokenizer, building it if `rank_is_writer`.

    The cache lives in `data_cfg.cache_dir/<key>/` (tokens.bin plus meta.json); the key hashes the bytes
    read, the tokenizer's name and max_bytes, so a found cache is reused without tokenizing again. With
    `rank_is_writer=False` nothing is written: call it on the other ranks only after a barrier that
    follows the writer's call.
    """
    docs = _read_documents(source_files(data_cfg.path), data_cfg.max_bytes)
    h = hashlib.sha256()
    for d in docs:
        h.update(hashlib.sha256(d).digest())  # per-document digests keep file boundaries in the key
    h.update(f"{tokenizer.name}|{data_cfg.max_bytes}".encode())
    folder = Path(data_cfg.cache_dir) / h.hexdigest()[:20]
    tokens_path, meta_path = folder / "tokens.bin", folder / "meta.json"
    if meta_path.is_file() or not rank_is_writer:
        return tokens_path
    folder.mkdir(parents=True, exist_ok=True)
    tokens = _encode(docs, tokenizer)
    _write_atomic(tokens_path, tokens.tobytes())
    meta = {"dtype": str(tokens.dtype), "n_tokens": int(tokens.size), "tokenizer": tokenizer.name,
            "documents": len(docs)}
    _write_atomic(meta_path, json.dumps(meta).encode())  # written last: its presence marks a complete cache
    return tokens_path


class PackedSequences:
    """Non-overlapping windows of seq_len + 1 tokens; the last val_fraction of them are validation."""

    def __init__(self, token_path: Path, seq_len: int, split: str, val_fraction: float):
        meta_path = Path(token_path).parent / "meta.json"
        if not meta_path.is_file():
            raise ConfigError(f"Token cache {token_path} is missing or incomplete (no meta.json). In a "
                              "distributed run the writer rank must build it before a barrier; otherwise "
                              f"delete {Path(token_path).parent} and run again.")
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        meta = json.loads(meta_path.read_text())
        dtype = np.dtype(meta["dtype"])
        # numpy cannot map an empty file; an empty corpus then fails the size check below
        self.tokens = (np.memmap(token_path, dtype=dtype, mode="r") if meta["n_tokens"] > 0
                       else np.zeros(0, dtype))
        self.seq_len = seq_len
        windows = len(self.tokens) // (seq_len + 1)
        n_val = math.ceil(val_fraction * windows) if val_fraction > 0 else 0
        if windows - n_val < 1:
            raise ConfigError(f"The corpus has {len(self.tokens)} tokens; training needs at least "
                              f"{(seq_len + 1) * (n_val + 1)} for one sequence of train.seq_len={seq_len} plus "
                              "validation. Use a smaller train.seq_len or more data (data.path, data.max_bytes).")
        self.start, self.count = (windows - n_val, n_val) if split == "val" else (0, windows - n_val)

    def __len__(self) -> int:
        return self.count

    def pair(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of window i: its first seq_len tokens and its last seq_len tokens."""
        window = self[i]
        return window[:-1], window[1:]

    def __getitem__(self, i: int) -> torch.Tensor:
        """Window i of this split: seq_len + 1 token ids (inputs are [:-1], targets [1:])."""
        if not 0 <= i < self.count:
            raise IndexError(f"window {i} out of range for a split of {self.count}")
        w = self.start + i
        chunk = self.tokens[w * (self.seq_len + 1):(w + 1) * (self.seq_len + 1)]
        return torch.from_numpy(chunk.astype(np.int64))


class GlobalBatchSampler:
    """Deterministic, infinite: epoch e is a permutation drawn from seed + e; resumable by position."""

    def __init__(self, num_sequences: int, global_batch: int, seed: int):
        if num_sequences < 1 or global_batch < 1:
            raise ConfigError(f"The sampler needs at least one sequence and a global batch of at least one, "
                              f"got {num_sequences} sequences and train.global_batch={global_batch}.")
        self.n, self.global_batch, self.seed = num_sequences, global_batch, seed
        self.epoch, self.position = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.n, generator=gen).tolist()

    def next_batch(self) -> list[int]:
        """The next global_batch indices; a batch that reaches the end of an epoch continues into the next."""
        out = []
        while len(out) < self.global_batch:
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            take = min(self.global_batch - len(out), self.n - self.position)
            out.extend(self._perm[self.position:self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict:
        """The epoch and the position within it, for resuming."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved epoch and position."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._perm = self._permutation(self.epoch)


def _micro_batches(dataset, indices: list[int], micro_batch: int) -> list[tuple]:
    """(inputs, targets) stacks of `micro_batch` sequences each, from a dataset's `pair`."""
    out = []
    for i in range(0, len(indices), micro_batch):
        pairs = [dataset.pair(j) for j in indices[i:i + micro_batch]]
        out.append((torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])))
    return out


class TrainBatches:
    """This data rank's micro-batches for each optimizer step."""

    def __init__(self, dataset, sampler: GlobalBatchSampler, micro_batch: int,
                 data_rank: int, data_world: int):
        check_global_batch(sampler.global_batch, micro_batch, data_world)  # the layout's rule, its words
        if not 0 <= data_rank < data_world:
            raise ValueError(f"data_rank {data_rank} is outside 0..{data_world - 1}")
        self.dataset, self.sampler = dataset, sampler
        self.micro_batch, self.rank, self.world = micro_batch, data_rank, data_world

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Draw one global batch; return this rank's micro-batches, each (inputs, targets) of
        shape (micro_batch, seq_len)."""
        indices = self.sampler.next_batch()
        per_rank = len(indices) // self.world
        mine = indices[self.rank * per_rank:(self.rank + 1) * per_rank]
        return _micro_batches(self.dataset, mine, self.micro_batch)

    def state_dict(self) -> dict:
        """The sampler's state (where the next global batch starts)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore the sampler's state."""
        self.sampler.load_state_dict(state)


def validation_batches(dataset, micro_batch: int, n_batches: int, data_rank: int,
                       data_world: int) -> list[tuple]:
    """A fixed validation set: n_batches micro-batches per rank, sliced across ranks like training."""
    if len(dataset) == 0 or n_batches == 0:
        return []
    per_rank = micro_batch * n_batches
    indices = [i % len(dataset) for i in range(data_rank * per_rank, (data_rank + 1) * per_rank)]
    return _micro_batches(dataset, indices, micro_batch)


def check_vocab(tokenizer, vocab_size: int) -> None:
    """Raise ConfigError unless the model's embedding has a row for every id the tokenizer produces."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"The tokenizer has {tokenizer.vocab_size} ids but model.vocab_size is "
                          f"{vocab_size}; raise model.vocab_size to at least {tokenizer.vocab_size}.")


def data_format(data_cfg: DataConfig) -> str:
    """'text' or 'jsonl': data.format, or for 'auto' jsonl exactly when every file data.path names ends in .jsonl."""
    if data_cfg.format != "auto":
        if data_cfg.format == "jsonl" and data_cfg.path is None:
            raise ConfigError("data.format jsonl needs data.path: a .jsonl file, a directory of them or a glob.")
        return data_cfg.format
    if data_cfg.path is None:
        return "text"
    return "jsonl" if all(f.suffix == ".jsonl" for f in source_files(data_cfg.path)) else "text"


def check_data_source(cfg: Config) -> None:
    """The data rules checkable before any work: data.path names text files (when set), the tokenizer loads and
    model.vocab_size covers it; for jsonl data, every record is well formed and the chat template loads."""
    if cfg.data.path is not None:
        files = source_files(cfg.data.path)
        if data_format(cfg.data) == "jsonl":
            chat_template_for(cfg.data)
            read_records(files)
    check_vocab(load_tokenizer(cfg.data.tokenizer), cfg.model.vocab_size)


def build_data(cfg: Config, data_rank: int, data_world: int, is_writer: bool):
    """(tokenizer, TrainBatches, validation micro-batches) for this rank; see the module docstring for barriers."""
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    check_vocab(tokenizer, cfg.model.vocab_size)
    t = cfg.train
    if data_format(cfg.data) == "jsonl":
        train_set, val_set = chat_sequences(cfg.data, source_files(cfg.data.path), t.seq_len, tokenizer,
                                            chat_template_for(cfg.data), is_writer)
    else:
        path = token_file(cfg.data, tokenizer, is_writer)
        train_set = PackedSequences(path, t.seq_len, "train", cfg.data.val_fraction)
        val_set = PackedSequences(path, t.seq_len, "val", cfg.data.val_fraction)
    sampler = GlobalBatchSampler(len(train_set), t.global_batch, t.seed)
    batches = TrainBatches(train_set, sampler, t.micro_batch, data_rank, data_world)
    val = validation_batches(val_set, t.micro_batch, t.val_batches, data_rank, data_world)
    return tokenizer, batches, val
