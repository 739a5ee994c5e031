"""The whole-model entry points the importers and exporters use, re-exported from fourfold.checkpoint.consolidated.

    write_consolidated(out_dir, {"model": {...}, "data": {...}}, tensors, extra_files={"tokenizer.json": b"..."})
    config, tensors = read_model_tensors("runs/x")  # any checkpoint (sharded or consolidated) or run directory
    consolidate("runs/x", "out/model")              # the two above, plus the checkpoint's tokenizer files

hf_import, hf_export, gguf_import and `fourfold convert` import them from here; the implementation (the
sharded DCP format, a consolidated directory being a checkpoint with one chunk per tensor) lives in
`fourfold.checkpoint.consolidated`.
"""

from __future__ import annotations

from fourfold.checkpoint.consolidated import consolidate, extra_files_of, read_model_tensors, shard_consolidated, \
    write_consolidated

__all__ = ["write_consolidated", "read_model_tensors", "consolidate", "extra_files_of", "shard_consolidated"]
