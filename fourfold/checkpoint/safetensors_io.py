"""safetensors files written in pieces (block by block, or tensor by tensor with a running sha256), and read
one tensor (or one block of it) at a time by name.

    with SafetensorsWriter(path, [(name, shape, dtype), ...]) as out:
        out.write_block(name, offset, block)        # any rectangular block of a tensor, in any order
    with SequentialSafetensorsWriter(path, specs) as out:
        out.write(name, tensor)                     # each tensor whole, in the order of specs; out.sha256 after
    reader = TensorReader([path, ...]); reader.shape(name); reader.get(name); reader.get_block(name, offset, shape)

Why our own writer: safetensors' Python API (`save_file`, `save`) takes the whole dict of tensors at once,
so saving a model would hold every full tensor in memory together, and it has no incremental writer.
The format is simple enough to write in pieces: 8 bytes of little-endian header length, a JSON header
giving each tensor's dtype, shape and byte range, then the raw little-endian bytes, row-major. The
header needs only names, shapes and dtypes, known before any data moves, so it is written first; each
block of a tensor (a rank's shard) is then written at its place (one write per contiguous run of
bytes) as soon as it arrives, and dropped. The files load with safetensors' own `load_file` /
`safe_open` (tests read them so).

Reading uses safetensors' `safe_open` (memory-mapped, header parsed up front): a whole tensor, or only
the block of it a rank holds (`get_block`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from fourfold.errors import CheckpointError

DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _header(specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> tuple[bytes, dict[str, int]]:
    """(length-prefixed JSON header padded to 8 bytes, name -> byte offset of its data from the data start)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    starts, offset = {}, 0
    for name, shape, dtype in specs:
        if dtype not in DTYPE_CODES:
            raise CheckpointError(f"Cannot write tensor '{name}' of dtype {dtype} to safetensors.")
        nbytes = math.prod(shape) * _itemsize(dtype)
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        starts[name] = offset
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, starts


def contiguous_runs(shape: tuple[int, ...], offset: tuple[int, ...], block: tuple[int, ...]):
    """(element index in the full row-major tensor, elements) of each contiguous run of the block
    full[offset : offset + block], in the block's own row-major order."""
    n = len(shape)
    first_full = n  # trailing dims the block covers whole are contiguous together
    while first_full > 0 and offset[first_full - 1] == 0 and block[first_full - 1] == shape[first_full - 1]:
        first_full -= 1
    if first_full == 0:
        yield 0, math.prod(shape)
        return
    partial = first_full - 1
    strides = [math.prod(shape[d + 1:]) for d in range(n)]
    run = block[partial] * strides[partial]
    for index in itertools.product(*(range(block[d]) for d in range(partial))):
        start = sum((offset[d] + i) * strides[d] for d, i in enumerate(index)) + offset[partial] * strides[partial]
        yield start, run


class SafetensorsWriter:
    """A safetensors file whose header is written at once and whose tensors are filled in block by block."""

    def __init__(self, path: Path, specs: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.path = Path(path)
        header, self._starts = _header(specs)
        self._specs = {name: (tuple(shape), dtype) for name, shape, dtype in specs}
        self._data_start = len(header)
        self._written = dict.fromkeys(self._specs, 0)
        self._file = open(self.path, "wb")
        self._file.write(header)
        self._file.truncate(self._data_start + sum(math.prod(s) * _itemsize(d) for s, d in self._specs.values()))

    def write_block(self, name: str, offset: tuple[int, ...], block: torch.Tensor) -> None:
        """Write `block`, the part full[offset : offset + block.shape] of tensor `name`, at its place."""
        shape, dtype = self._specs[name]
        if block.dtype != dtype or len(block.shape) != len(shape) or any(
                o + b > s for o, b, s in zip(offset, block.shape, shape)):
            raise CheckpointError(f"Block {tuple(block.shape)} {block.dtype} at {tuple(offset)} does not fit tensor "
                                  f"'{name}' {shape} {dtype}.")
        data = block.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        size = _itemsize(dtype)
        base = self._data_start + self._starts[name]
        done = 0
        for start, count in contiguous_runs(shape, tuple(offset), tuple(block.shape)):
            os.pwrite(self._file.fileno(), data[done:done + count * size].data, base + start * size)
            done += count * size
        self._written[name] += block.numel()

    def close(self) -> None:
        """Check every tensor was written whole, then flush, fsync and close the file."""
        try:
            short = [n for n, (s, _) in self._specs.items() if self._written[n] != math.prod(s)]
            if short:
                raise CheckpointError(f"{self.path}: tensors {short[:5]} were not written whole.")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()


class SequentialSafetensorsWriter:
    """A safetensors file written front to back, each tensor whole and in the order of `specs`, with a running
    sha256 of every byte (`sha256` and `size` once closed): one tensor in host memory at a time."""

    def __init__(self, path: Path, specs: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.path = Path(path)
        header, _ = _header(specs)
        self._specs = [(name, tuple(shape), dtype) for name, shape, dtype in specs]
        self._next = 0
        self._hash = hashlib.sha256(header)
        self.size = len(header)
        self.sha256 = ""
        self._file = open(self.path, "wb")
        self._file.write(header)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor of the specs, `name`, whole."""
        expected, shape, dtype = self._specs[self._next]
        if name != expected or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise CheckpointError(f"{self.path}: got '{name}' {tuple(tensor.shape)} {tensor.dtype} where '{expected}' "
                                  f"{shape} {dtype} comes next.")
        data = memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
        self._file.write(data)
        self._hash.update(data)
        self.size += len(data)
        self._next += 1

    def close(self) -> None:
        """Check every tensor was written, then flush, fsync and close the file."""
        try:
            if self._next != len(self._specs):
                raise CheckpointError(f"{self.path}: tensors {[s[0] for s in self._specs[self._next:]][:5]} were "
                                      "not written.")
            self._file.flush()
            os.fsync(self._file.fileno())
            self.sha256 = self._hash.hexdigest()
        finally:
            self._file.close()

    def __enter__(self) -> "SequentialSafetensorsWriter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self._file.close()


class TensorReader:
    """Tensors by name across several safetensors files; each read returns one full tensor on the CPU."""

    def __init__(self, files: list[Path]):
        self.files: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        for path in files:
            handle = self._open(path)
            self._handles[path] = handle
            for name in handle.keys():
                self.files[name] = path

    @staticmethod
    def _open(path: Path):
        try:
            return safe_open(str(path), framework="pt")
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"Checkpoint file {path} is truncated or corrupt ({e}); resume from an earlier "
                                  "checkpoint or retrain.") from None

    def names(self) -> list[str]:
        """Every tensor name in the files."""
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of tensor `name` from the file header, or None if no file holds it."""
        path = self.files.get(name)
        return None if path is None else tuple(self._handles[path].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name`, full, on the CPU (CheckpointError naming the file if it cannot be read)."""
        return self.get_block(name, (), ())

    def get_block(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """full[offset : offset + shape] of tensor `name`, read from the file alone, on the CPU; () reads it all."""
        path = self.files[name]
        try:
            if not shape:
                return self._handles[path].get_tensor(name)
            return self._handles[path].get_slice(name)[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"Checkpoint file {path}: tensor '{name}' cannot be read ({e}); resume from an "
                                  "earlier checkpoint or retrain.") from None
