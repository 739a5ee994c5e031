"""Asynchronous checkpoints: training stalls only while this rank's state is copied to host memory.

    saver = AsyncSaver()                    # collective: makes the gloo group the background saves talk over
    stall = saver.save(run_dir, step, model, optimizer, meta, keep, extra_files=..., protect=...)
    seconds = saver.wait()                  # the previous save's duration (the next save and the end call it)

`save` first waits for the previous save, then copies every tensor this rank holds (DTensor shards stay
DTensors, with host-memory local parts) and returns; a background thread writes the copy through
`write_checkpoint`, whose DCP collectives and barriers run on a separate gloo process group so that they
never interleave with the training step's collectives. The host copy is one rank's shards of model and
optimizer state: that is the extra host memory an asynchronous save costs.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fourfold.checkpoint.store import checkpoint_state, gather_param_groups, write_checkpoint


def stage_to_host(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A host-memory copy of each tensor (a DTensor's local shard, kept a DTensor), independent of training."""
    out = {}
    for name, t in state.items():
        if isinstance(t, DTensor):
            local = t.to_local().detach().to("cpu", copy=True)
            # Not DTensor.from_local, which moves a local tensor to the mesh's device type (back onto the GPU);
            # the constructor keeps it where it is, as DCP's own staging does.
            out[name] = DTensor(local, t._spec, requires_grad=False)
        else:
            out[name] = t.detach().to("cpu", copy=True)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return out


def _timed(*args):
    """write_checkpoint(*args) in the background thread: (its directory, the seconds it took)."""
    begin = time.perf_counter()
    path = write_checkpoint(*args)
    return path, time.perf_counter() - begin


class AsyncSaver:
    """Writes checkpoints in a background thread; at most one save in flight."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fourfold-checkpoint")
        self._pending: Future | None = None
        self.last_path = None

    def save(self, run_dir, step: int, model, optimizer, meta: dict, keep: int, extra_files=None,
             protect=()) -> float:
        """Start saving checkpoint `step`; returns the seconds training stalled (waiting + copying)."""
        begin = time.perf_counter()
        self.wait()
        groups = gather_param_groups(model, optimizer) if optimizer is not None else None
        staged = stage_to_host(checkpoint_state(model, optimizer))
        self._pending = self._pool.submit(_timed, run_dir, step, staged, groups, meta, keep, extra_files, protect,
                                          self.group)
        return time.perf_counter() - begin

    @property
    def pending(self) -> bool:
        """Whether a save was started and not yet waited for."""
        return self._pending is not None

    def running_done(self) -> bool:
        """Whether the save in flight (if any) has finished writing (without waiting for it)."""
        return self._pending is None or self._pending.done()

    def wait(self) -> float | None:
        """Wait for the save in flight (re-raising its error); the seconds its writing took, or None."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        self.last_path, seconds = pending.result()
        return seconds

    def close(self) -> None:
        """Wait for the last save and stop the thread."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
