"""safetensors files written tensor by tensor, with a running sha256 of every byte.

    with SequentialSafetensorsWriter(path, [(name, shape, dtype), ...]) as out:
        out.write(name, tensor)                     # each tensor whole, in the order of specs; out.sha256 after

Why our own writer: safetensors' Python API (`save_file`, `save`) takes the whole dict of tensors at once,
so saving a model would hold every full tensor in memory together, and it has no incremental writer.
The format is simple enough to write in pieces: 8 bytes of little-endian header length, a JSON header
giving each tensor's dtype, shape and byte range, then the raw little-endian bytes, row-major. The
header needs only names, shapes and dtypes, known before any data moves, so it is written first and the
tensors follow one at a time, hashed as they go (the COMPLETE marker records the hash). The files load
with safetensors' own `safe_open` (fourfold.checkpoint.dcp_storage reads them so).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

import torch

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
