"""Checkpoints: sharded save and load through torch.distributed.checkpoint (safetensors + JSON, no pickle),
resharding between layouts, atomic and checksummed, asynchronous saves, and whole-model conversion tools."""
