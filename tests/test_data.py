"""Tests for the data pipeline: tokenizers, the cached token file, packing, the sampler and per-rank batches.

Every expectation is computed independently of the code under test (from the raw bytes, from
torch.randperm, or from the single-process batches), never hard-coded from a run.
"""

from __future__ import annotations

import json
import math
import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from fourfold.config import DataConfig, build_config
from fourfold.errors import ConfigError
from fourfold.train import dataset as data_mod
from fourfold.train.dataset import (GlobalBatchSampler, PackedSequences, TrainBatches, build_data, source_files,
                                 token_file, validation_batches)
from fourfold.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

SENTENCES = ["def add(a, b): return a + b", "class Point: pass", "the quick brown fox jumps over the lazy dog",
             "print('hello world')", "for i in range(10): total += i"]


def train_bpe(path: Path, vocab_size: int = 300, eos: str | None = "</s>") -> Path:
    """Train a tiny byte-level BPE on SENTENCES and save it as a tokenizer.json (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [eos] if eos else []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 4, trainer=trainer)
    tok.save(str(path))
    return path


def write_docs(folder: Path, texts: dict[str, str]) -> Path:
    """Write {relative name: text} under folder and return it."""
    for name, text in texts.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def data_cfg(tmp_path: Path, path: Path | str, **kw) -> DataConfig:
    return DataConfig(path=str(path), cache_dir=str(tmp_path / "cache"), **kw)


def byte_corpus(tmp_path: Path, n_tokens: int, seq_len: int, val_fraction: float) -> tuple[Path, np.ndarray]:
    """A one-document corpus of n_tokens byte tokens (n_tokens - 1 bytes + eos): (token path, tokens)."""
    text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(n_tokens - 1))
    src = tmp_path / "corpus.txt"
    src.write_text(text)
    path = token_file(data_cfg(tmp_path, src, max_bytes=0), ByteTokenizer())
    expected = np.array(list(text.encode()) + [ByteTokenizer.eos_id])
    return path, expected


# ----- tokenizers -----------------------------------------------------------------------------------

def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓ def f(): pass\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id]) == text  # eos is skipped
    assert (tok.vocab_size, tok.eos_id, tok.name) == (257, 256, "byte")
    assert tok.decode([0xC3]) == "\ufffd"  # a cut UTF-8 sequence decodes with replacement


def test_bpe_tokenizer_round_trip_and_eos(tmp_path):
    path = train_bpe(tmp_path / "tok.json")
    tok = load_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer)
    for s in SENTENCES:
        ids = tok.encode(s)
        assert len(ids) < len(s.encode())  # merges were learned and used
        assert tok.decode(ids) == s
    assert tok.encode_batch(SENTENCES) == [tok.encode(s) for s in SENTENCES]
    from tokenizers import Tokenizer
    raw = Tokenizer.from_file(str(path))
    assert tok.vocab_size == raw.get_vocab_size()
    assert tok.eos_id == raw.token_to_id("</s>")
    no_eos = load_tokenizer(str(train_bpe(tmp_path / "noeos.json", eos=None)))
    assert no_eos.eos_id is None
    assert tok.name != no_eos.name and tok.name.startswith("hf-")  # the name hashes the file


def test_load_tokenizer_errors(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="nope.json.*tokenizer.json"):
        load_tokenizer(str(missing))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json.*'byte'"):
        load_tokenizer(str(bad))


# ----- sources --------------------------------------------------------------------------------------

def test_source_files_file_dir_glob(tmp_path):
    root = write_docs(tmp_path / "src", {"b.txt": "b", "a.txt": "a", "sub/c.py": "c", ".hidden/d.txt": "d"})
    (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    assert source_files(str(root / "a.txt")) == [root / "a.txt"]
    assert source_files(str(root)) == [root / "a.txt", root / "b.txt", root / "sub" / "c.py"]
    assert source_files(str(root / "*.txt")) == [root / "a.txt", root / "b.txt"]
    assert source_files(str(root / "**" / "*.py")) == [root / "sub" / "c.py"]


def test_source_files_errors(tmp_path):
    with pytest.raises(ConfigError, match="missing_dir.*does not exist"):
        source_files(str(tmp_path / "missing_dir"))
    with pytest.raises(ConfigError, match=r"\*\.md.*matches no files"):
        source_files(str(tmp_path / "*.md"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no text files"):
        source_files(str(tmp_path / "empty"))


def test_binary_data_is_named_and_reported_as_skipped(tmp_path):
    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"\x00\x01\x02binary" * 10)
    with pytest.raises(ConfigError, match=r"weights\.bin' is a binary file.*not text.*skipped"):
        source_files(str(blob))
    with pytest.raises(ConfigError, match=r"matches only binary files \(.*weights\.bin\).*skipped as not text"):
        source_files(str(tmp_path / "*.bin"))
    (tmp_path / "notes.txt").write_text("text")
    assert source_files(str(tmp_path / "*")) == [tmp_path / "notes.txt"]  # binary matches are left out


def test_stdlib_default_excludes_site_packages(tmp_path, monkeypatch):
    fake = write_docs(tmp_path / "lib", {"os.py": "x", "json/__init__.py": "x", "notes.txt": "x",
                                         "site-packages/pkg.py": "x", "dist-packages/pkg2.py": "x",
                                         "__pycache__/os.py": "x"})
    real_get_paths = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**real_get_paths(*a, **k), "stdlib": str(fake)})
    assert source_files(None) == [fake / "json" / "__init__.py", fake / "os.py"]


def test_stdlib_default_real():
    files = source_files(None)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert stdlib / "os.py" in files and files == sorted(files)
    assert all(f.suffix == ".py" for f in files)
    assert not any({"site-packages", "dist-packages", "__pycache__"} & set(f.parts) for f in files)


# ----- token cache ----------------------------------------------------------------------------------

def test_token_file_contents_and_sidecar(tmp_path):
    root = write_docs(tmp_path / "src", {"b.txt": "second ✓", "a.txt": "first"})
    path = token_file(data_cfg(tmp_path, root), ByteTokenizer())
    tokens = np.fromfile(path, dtype=np.uint16)
    eos = ByteTokenizer.eos_id
    expected = list("first".encode()) + [eos] + list("second ✓".encode()) + [eos]  # sorted file order
    assert tokens.tolist() == expected
    meta = json.loads((path.parent / "meta.json").read_text())
    assert meta == {"dtype": "uint16", "n_tokens": len(expected), "tokenizer": "byte", "documents": 2}
    assert path.parent.parent == tmp_path / "cache"


def test_token_file_max_bytes(tmp_path):
    root = write_docs(tmp_path / "src", {"a.txt": "a" * 30, "b.txt": "b" * 30, "c.txt": "c" * 30})
    path = token_file(data_cfg(tmp_path, root, max_bytes=45), ByteTokenizer())
    eos = ByteTokenizer.eos_id
    assert np.fromfile(path, dtype=np.uint16).tolist() == [97] * 30 + [eos] + [98] * 15 + [eos]
    other = token_file(data_cfg(tmp_path, root, max_bytes=50), ByteTokenizer())
    assert other != path  # max_bytes is part of the key


def test_token_file_hf_tokenizer(tmp_path):
    tok = load_tokenizer(str(train_bpe(tmp_path / "tok.json")))
    root = write_docs(tmp_path / "src", {"a.txt": SENTENCES[0], "b.txt": SENTENCES[1]})
    path = token_file(data_cfg(tmp_path, root), tok)
    expected = tok.encode(SENTENCES[0]) + [tok.eos_id] + tok.encode(SENTENCES[1]) + [tok.eos_id]
    assert np.fromfile(path, dtype=np.uint16).tolist() == expected
    assert token_file(data_cfg(tmp_path, root), ByteTokenizer()) != path  # tokenizer is part of the key


def test_token_cache_built_once_and_reused(tmp_path, monkeypatch):
    root = write_docs(tmp_path / "src", {"a.txt": "some text " * 20})
    calls = []
    real_encode = data_mod._encode
    monkeypatch.setattr(data_mod, "_encode", lambda *a: calls.append(1) or real_encode(*a))
    cfg = data_cfg(tmp_path, root)
    reader_path = token_file(cfg, ByteTokenizer(), rank_is_writer=False)
    assert not reader_path.exists() and calls == []  # a non-writer only locates the file
    first = token_file(cfg, ByteTokenizer())
    mtime = first.stat().st_mtime_ns
    second = token_file(cfg, ByteTokenizer())
    assert first == second == reader_path and len(calls) == 1 and second.stat().st_mtime_ns == mtime
    (root / "a.txt").write_text("changed text " * 20)
    assert token_file(cfg, ByteTokenizer()) != first and len(calls) == 2  # content is part of the key


def test_interrupted_write_leaves_no_valid_cache(tmp_path, monkeypatch):
    root = write_docs(tmp_path / "src", {"a.txt": "abcdefgh" * 10})
    cfg = data_cfg(tmp_path, root)
    folder = token_file(cfg, ByteTokenizer(), rank_is_writer=False).parent
    seen_at_crash = []

    def crash(fd):  # a process killed mid-write runs no clean-up: look at the folder as it stands then
        seen_at_crash.extend(sorted(p.name for p in folder.iterdir()))
        raise OSError("disk gone")

    monkeypatch.setattr(os, "fsync", crash)  # the first write dies before its rename
    with pytest.raises(OSError, match="disk gone"):
        token_file(cfg, ByteTokenizer())
    assert len(seen_at_crash) == 1 and seen_at_crash[0] not in ("tokens.bin", "meta.json")  # only a temp file
    assert list(folder.iterdir()) == []  # and the temp file is removed on an ordinary exception
    monkeypatch.undo()
    path = token_file(cfg, ByteTokenizer())  # the next run builds it cleanly
    assert np.fromfile(path, dtype=np.uint16).size == 81


def test_crash_between_tokens_and_sidecar_is_not_valid(tmp_path, monkeypatch):
    root = write_docs(tmp_path / "src", {"a.txt": "abcdefgh" * 10})
    cfg = data_cfg(tmp_path, root)
    real_write = data_mod._write_atomic

    def write_tokens_only(path, data):
        if path.name == "meta.json":
            raise KeyboardInterrupt
        real_write(path, data)

    monkeypatch.setattr(data_mod, "_write_atomic", write_tokens_only)
    with pytest.raises(KeyboardInterrupt):
        token_file(cfg, ByteTokenizer())
    monkeypatch.undo()
    path = token_file(cfg, ByteTokenizer(), rank_is_writer=False)
    assert path.exists()
    with pytest.raises(ConfigError, match="incomplete"):
        PackedSequences(path, 8, "train", 0.1)
    token_file(cfg, ByteTokenizer())  # rebuilt, since the sidecar marks completeness
    assert len(PackedSequences(path, 8, "train", 0.0)) == 81 // 9


# ----- packing and splits ---------------------------------------------------------------------------

def test_packed_windows_and_split_sizes(tmp_path):
    seq_len, frac = 7, 0.1
    path, tokens = byte_corpus(tmp_path, n_tokens=205, seq_len=seq_len, val_fraction=frac)
    n = 205 // (seq_len + 1)
    n_val = math.ceil(frac * n)
    train, val = PackedSequences(path, seq_len, "train", frac), PackedSequences(path, seq_len, "val", frac)
    assert (len(train), len(val)) == (n - n_val, n_val)
    windows = [train[i] for i in range(len(train))] + [val[i] for i in range(len(val))]
    for w, window in enumerate(windows):
        assert window.dtype == torch.long and window.shape == (seq_len + 1,)
        assert window.tolist() == tokens[w * (seq_len + 1):(w + 1) * (seq_len + 1)].tolist()
    with pytest.raises(IndexError):
        train[len(train)]
    assert len(PackedSequences(path, seq_len, "val", 0.0)) == 0
    assert len(PackedSequences(path, seq_len, "val", 0.001)) == 1  # at least one when val_fraction > 0


def test_inputs_and_targets_are_shifted(tmp_path):
    seq_len = 8
    path, _ = byte_corpus(tmp_path, n_tokens=400, seq_len=seq_len, val_fraction=0.0)
    ds = PackedSequences(path, seq_len, "train", 0.0)
    batches = TrainBatches(ds, GlobalBatchSampler(len(ds), 4, seed=0), micro_batch=2, data_rank=0, data_world=1)
    for inputs, targets in batches.next_step():
        assert inputs.shape == targets.shape == (2, seq_len)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])
    sampler = GlobalBatchSampler(len(ds), 4, seed=0)
    first = sampler.next_batch()[0]
    inputs, targets = TrainBatches(ds, GlobalBatchSampler(len(ds), 4, seed=0), 2, 0, 1).next_step()[0]
    assert torch.equal(inputs[0], ds[first][:-1]) and torch.equal(targets[0], ds[first][1:])


def test_too_little_data(tmp_path):
    path, _ = byte_corpus(tmp_path, n_tokens=20, seq_len=32, val_fraction=0.0)
    with pytest.raises(ConfigError, match=r"20 tokens.*33.*train\.seq_len"):
        PackedSequences(path, 32, "train", 0.0)
    path, _ = byte_corpus(tmp_path, n_tokens=40, seq_len=32, val_fraction=0.1)  # one window, taken by val
    with pytest.raises(ConfigError, match="40 tokens.*66"):
        PackedSequences(path, 32, "train", 0.1)


# ----- sampler ------------------------------------------------------------------------------------

def test_sampler_epochs_are_seeded_permutations():
    n, g, seed = 10, 4, 7
    sampler = GlobalBatchSampler(n, g, seed)
    drawn = [i for _ in range(15) for i in sampler.next_batch()]  # 60 indices = 6 epochs, batches straddle
    for e in range(6):
        expected = torch.randperm(n, generator=torch.Generator().manual_seed(seed + e)).tolist()
        assert drawn[e * n:(e + 1) * n] == expected
    again = GlobalBatchSampler(n, g, seed)
    assert [i for _ in range(15) for i in again.next_batch()] == drawn
    other = GlobalBatchSampler(n, g, seed + 100)
    assert [i for _ in range(15) for i in other.next_batch()] != drawn


@pytest.mark.parametrize("steps_before", [0, 1, 3, 7])
def test_sampler_resume_is_exact(steps_before):
    n, g, seed = 10, 4, 3
    sampler = GlobalBatchSampler(n, g, seed)
    for _ in range(steps_before):
        sampler.next_batch()
    state = json.loads(json.dumps(sampler.state_dict()))  # as a checkpoint would store it
    continued = [sampler.next_batch() for _ in range(6)]
    restored = GlobalBatchSampler(n, g, seed)
    restored.load_state_dict(state)
    assert [restored.next_batch() for _ in range(6)] == continued


def test_sampler_rejects_empty_dataset():
    with pytest.raises(ConfigError):
        GlobalBatchSampler(0, 4, 0)


# ----- per-rank slicing ---------------------------------------------------------------------------

@pytest.fixture
def packed(tmp_path):
    path, _ = byte_corpus(tmp_path, n_tokens=9 * 40, seq_len=8, val_fraction=0.2)
    return PackedSequences(path, 8, "train", 0.2), PackedSequences(path, 8, "val", 0.2)


@pytest.mark.parametrize("data_world", [1, 2, 4])
def test_rank_slices_concatenate_to_single_process(packed, data_world):
    train, _ = packed
    global_batch, micro = 8, 2
    single = TrainBatches(train, GlobalBatchSampler(len(train), global_batch, 5), micro, 0, 1)
    ranks = [TrainBatches(train, GlobalBatchSampler(len(train), global_batch, 5), micro, r, data_world)
             for r in range(data_world)]
    for _ in range(6):  # 48 windows from 32: crosses an epoch boundary
        reference = single.next_step()
        per_rank = [b.next_step() for b in ranks]
        assert all(len(mbs) == global_batch // (micro * data_world) for mbs in per_rank)
        for part in (0, 1):  # inputs, then targets
            want = torch.cat([mb[part] for mb in reference])
            got = torch.cat([mb[part] for mbs in per_rank for mb in mbs])
            assert torch.equal(got, want)


def test_train_batches_resume(packed):
    train, _ = packed
    batches = TrainBatches(train, GlobalBatchSampler(len(train), 8, 1), 4, 1, 2)
    for _ in range(5):
        batches.next_step()
    state = batches.state_dict()
    continued = [batches.next_step() for _ in range(3)]
    restored = TrainBatches(train, GlobalBatchSampler(len(train), 8, 1), 4, 1, 2)
    restored.load_state_dict(state)
    for a, b in zip(continued, [restored.next_step() for _ in range(3)]):
        assert all(torch.equal(x, y) for mb_a, mb_b in zip(a, b) for x, y in zip(mb_a, mb_b))


def test_train_batches_rejects_indivisible_batch(packed):
    train, _ = packed
    with pytest.raises(ConfigError, match="global_batch"):
        TrainBatches(train, GlobalBatchSampler(len(train), 6, 0), 2, 0, 2)


@pytest.mark.parametrize("data_world", [1, 2, 4])
def test_validation_batches_slice_like_training(packed, data_world):
    _, val = packed
    micro, n_batches = 2, 3  # 2 * 3 * 4 = 24 windows wanted from 8: wraps for data_world > 1
    single = validation_batches(val, micro, n_batches * data_world, 0, 1)
    per_rank = [validation_batches(val, micro, n_batches, r, data_world) for r in range(data_world)]
    assert all(len(b) == n_batches for b in per_rank)
    got = torch.cat([mb[0] for b in per_rank for mb in b])
    assert torch.equal(got, torch.cat([mb[0] for mb in single]))
    wanted = [i % len(val) for i in range(micro * n_batches * data_world)]
    assert torch.equal(got, torch.stack([val[i][:-1] for i in wanted]))
    assert all(torch.equal(x[0], y[0]) for x, y in zip(per_rank[0],
                                                          validation_batches(val, micro, n_batches, 0, data_world)))


# ----- build_data ---------------------------------------------------------------------------------

def test_build_data(tmp_path):
    (tmp_path / "corpus.txt").write_text("hello world, " * 200)
    flat = {"data.path": str(tmp_path / "corpus.txt"), "data.cache_dir": str(tmp_path / "cache"),
            "train.global_batch": "4", "train.micro_batch": "2", "train.seq_len": "16", "train.val_batches": "2",
            "model.vocab_size": "300", "model.max_seq_len": "32"}
    cfg = build_config({}, flat)
    build_data(cfg, 0, 2, is_writer=True)
    tok, batches, val = build_data(cfg, 1, 2, is_writer=False)
    assert isinstance(tok, ByteTokenizer)
    step = batches.next_step()
    assert len(step) == 1 and step[0][0].shape == (2, 16)
    assert len(val) == 2 and val[0][1].shape == (2, 16)
    small = build_config({}, {**flat, "model.vocab_size": "128"})
    with pytest.raises(ConfigError, match="raise model.vocab_size to at least 257"):
        build_data(small, 0, 1, is_writer=True)
