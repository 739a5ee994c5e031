"""Run a function on N gloo ranks (torch.multiprocessing spawn) and collect each rank's return value.

    results = run_ranks(fn, world_size=4, args=(cfg_dict,))   # fn(rank, world_size, *args) -> picklable

Each child sets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), starts
a gloo process group, runs `fn`, and sends back its result; an exception in any rank fails the call with
that rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, fn, args, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        # Plain pickle copies tensors by value; the queue's own pickler would pass them as shared-memory
        # handles that vanish when this process exits.
        result = pickle.dumps(fn(rank, world_size, *args))
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, args: tuple = (), timeout: float = 300.0) -> list:
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks; return the results ordered by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, queue), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    for _ in range(world_size):
        rank, status, payload = queue.get()
        if status == "error":
            errors.append(f"rank {rank} failed:\n{payload}")
            break
        results[rank] = pickle.loads(payload)
    for p in procs:
        p.join(timeout=5 if errors else timeout)
        if p.is_alive():
            p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
