"""torch.distributed.checkpoint storage in safetensors files with JSON metadata: DCP's planning, no pickle.

    dcp.save(state_dict, storage_writer=SafetensorsStorageWriter(directory), planner=DefaultSavePlanner(...))
    dcp.load(state_dict, storage_reader=SafetensorsStorageReader(directory), planner=DefaultLoadPlanner(...))

DCP plans the save (each rank's DTensor shards as they are; a tensor several ranks hold whole, as DDP
replicas and ZeRO-1 owners do, is written once) and the load (each rank reads exactly the block of every
saved chunk that overlaps its own shard, so any layout loads any other). What DCP leaves to the storage
layer is how bytes reach the disk, and there fourfold differs from DCP's FileSystemWriter, whose
`.metadata` and tensor records are pickles: here each rank writes `model-<rank>.safetensors` and
`optim-<rank>.safetensors` holding its chunks of weights and of optimizer state (loading weights alone,
for inference or `init_from`, touches only the first kind; key: the tensor's name, followed by `@offsets`
when the chunk is not the whole tensor), streamed one chunk at a time with a running sha256, and the coordinator writes `metadata.json` (every
tensor's dtype, shape and chunks, and the file and key of each chunk). Loading reads only that JSON and
the safetensors headers and byte ranges; a state dict holding anything but tensors is refused.

Only this module's two classes talk to DCP's storage interface (stable since torch 2.2: reset,
set_up_*, prepare_*_plan, write_data/read_data, finish/read_metadata, validate_checkpoint_id).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from fourfold.checkpoint.safetensors_io import DTYPE_CODES, SequentialSafetensorsWriter
from fourfold.errors import CheckpointError

METADATA_FILE = "metadata.json"
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in DTYPE_CODES}


def shard_file(rank: int, kind: str) -> str:
    """The file rank `rank` writes its chunks of model weights (kind "model") or optimizer state ("optim") to."""
    return f"{kind}-{rank:05d}.safetensors"


def is_optimizer_entry(fqn: str) -> bool:
    """Whether a state-dict entry is optimizer state (`state.<param>.<key>`) rather than a model tensor."""
    return fqn.startswith("state.")


def files_for(record: dict, optimizer: bool) -> set[str]:
    """The shard files holding the model's chunks (and, with `optimizer`, the optimizer state's)."""
    return {c["file"] for c in record["storage"] if optimizer or not is_optimizer_entry(c["fqn"])}


def chunk_key(fqn: str, offsets, sizes, size) -> str:
    """The safetensors key of a chunk: the name alone for a whole tensor, else name@offsets."""
    if tuple(sizes) == tuple(size):
        return fqn
    return f"{fqn}@{','.join(str(o) for o in offsets)}"


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class SafetensorsStorageWriter(StorageWriter):
    """DCP storage writer: this rank's chunks into one safetensors file; metadata.json by the coordinator."""

    def __init__(self, directory: str | Path):
        super().__init__()
        self.directory = Path(directory)
        self.rank = 0
        self.is_coordinator = True

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.directory = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", None)
        if self.rank is None:
            self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def write_data(self, plan, planner) -> Future:
        items = [item for item in plan.items]
        if any(item.type == WriteItemType.BYTE_IO for item in items):
            names = [item.index.fqn for item in items if item.type == WriteItemType.BYTE_IO]
            raise CheckpointError(f"Only tensors go into checkpoint shards; {names[:5]} are not tensors.")
        results = []
        for kind, chosen in (("model", [i for i in items if not is_optimizer_entry(i.index.fqn)]),
                             ("optim", [i for i in items if is_optimizer_entry(i.index.fqn)])):
            if chosen:
                results += self._write_file(shard_file(self.rank, kind), chosen, planner)
        return _done(results)

    def _write_file(self, name: str, items: list, planner) -> list[WriteResult]:
        """Write `items` (whole chunks, in order) to the file `name`; their WriteResults."""
        specs, keys = [], {}
        for item in items:
            data = item.tensor_data
            key = chunk_key(item.index.fqn, data.chunk.offsets, data.chunk.sizes, data.size)
            keys[item.index] = key
            specs.append((key, tuple(data.chunk.sizes), data.properties.dtype))
        with SequentialSafetensorsWriter(self.directory / name, specs) as out:
            for item in items:
                tensor = planner.resolve_data(item)
                out.write(keys[item.index], tensor.detach())
                del tensor
        stored = {"file": name, "bytes": out.size, "sha256": out.sha256}
        return [WriteResult(index=item.index, size_in_bytes=item.tensor_storage_size() or 0,
                            storage_data={**stored, "key": keys[item.index]}) for item in items]

    def finish(self, metadata: Metadata, results) -> None:
        """On the coordinator: write metadata.json (fsynced) and remember each shard file's size and digest."""
        chunks_at = [{"fqn": r.index.fqn, "offset": list(r.index.offset or ()), "file": r.storage_data["file"],
                      "key": r.storage_data["key"]} for rank_results in results for r in rank_results]
        self.files = {r.storage_data["file"]: {"bytes": r.storage_data["bytes"], "sha256": r.storage_data["sha256"]}
                      for rank_results in results for r in rank_results}
        tensors = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"Only tensors go into checkpoint shards; '{fqn}' is not a tensor.")
            tensors[fqn] = {"dtype": str(md.properties.dtype).removeprefix("torch."), "shape": list(md.size),
                            "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks]}
        record = {"format": "fourfold-dcp-safetensors-1", "tensors": tensors, "storage": chunks_at}
        write_json(self.directory / METADATA_FILE, record)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True


def write_json(path: Path, record) -> None:
    """Write `record` as JSON to `path`, flushed and fsynced."""
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_storage_metadata(directory: Path) -> dict:
    """metadata.json of a checkpoint as a dict (CheckpointError naming the file if it is absent or invalid)."""
    path = Path(directory) / METADATA_FILE
    try:
        record = json.loads(path.read_text())
        record["tensors"], record["storage"]
        return record
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is missing or invalid ({e}); this is not a complete fourfold checkpoint.") \
            from None


def dcp_metadata(record: dict) -> Metadata:
    """DCP's Metadata object from our JSON record, with storage_data mapping each chunk to (file, key)."""
    tensors = {}
    for fqn, t in record["tensors"].items():
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in t["chunks"]]
        tensors[fqn] = TensorStorageMetadata(TensorProperties(dtype=DTYPES[t["dtype"]]), torch.Size(t["shape"]),
                                             chunks)
    storage = {MetadataIndex(c["fqn"], torch.Size(c["offset"])): (c["file"], c["key"]) for c in record["storage"]}
    return Metadata(state_dict_metadata=tensors, storage_data=storage)


class SafetensorsStorageReader(StorageReader):
    """DCP storage reader for what SafetensorsStorageWriter wrote: JSON metadata, safetensors byte ranges."""

    def __init__(self, directory: str | Path):
        super().__init__()
        self.directory = Path(directory)
        self.storage: dict = {}

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.directory = Path(checkpoint_id)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return dcp_metadata(read_storage_metadata(self.directory))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.storage = metadata.storage_data

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> Future:
        by_file = defaultdict(list)
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointError(f"Checkpoint entry '{item.storage_index.fqn}' is not a tensor; refusing to "
                                      "unpickle it.")
            by_file[self.storage[item.storage_index][0]].append(item)
        for name, items in by_file.items():
            path = self.directory / name
            try:
                with safe_open(str(path), framework="pt") as handle:
                    for item in items:
                        key = self.storage[item.storage_index][1]
                        index = tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
                        block = handle.get_slice(key)[index] if index else handle.get_tensor(key)
                        target = planner.resolve_tensor(item).detach()
                        if tuple(target.shape) != tuple(block.shape):
                            raise CheckpointError(f"{path}: chunk '{key}' gives {tuple(block.shape)} where "
                                                  f"{tuple(target.shape)} was expected.")
                        target.copy_(block)
                        planner.commit_tensor(item, target)
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"Checkpoint file {path} cannot be read ({e}); resume from an earlier "
                                      "checkpoint or retrain.") from None
        return _done(None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return (Path(checkpoint_id) / METADATA_FILE).is_file()
