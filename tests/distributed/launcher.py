"""Run a function on N gloo ranks, each a fresh process, and collect each rank's return value.

    results = run_ranks(fn, world_size=4, args=(cfg_dict,))   # fn(rank, world_size, *args) -> picklable

Each rank sets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), starts a
gloo process group, runs `fn`, and sends back its result; an exception in any rank, or a rank that dies
or runs past `timeout`, fails the call with that rank's traceback or exit code. The process group's own
timeout is a little shorter than `timeout`, so a rank stuck in a collective or a receive (two ranks that
disagree about who sends what) fails with a traceback that shows where.

Ranks are forked from a forkserver that imported torch and fourfold once (PRELOAD): every case still
gets fresh processes (no state carries from one case to the next), without paying torch's import in
every rank of every case, which on a 2-core machine was most of a small case's time.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

# What the forkserver imports before it forks any rank (a module it cannot import is skipped): torch and
# fourfold, and what they import on first use (DDP imports torch._dynamo; ZeRO-1 torch.distributed.optim;
# the pipeline's timeline picture matplotlib).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.optim",
           "torch.distributed.tensor.parallel", "numpy", "safetensors.torch", "matplotlib", "matplotlib.pyplot",
           "pytest", "fourfold.testing", "tests.distributed.launcher"]
_context = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_context():
    """The multiprocessing context ranks start from: a forkserver with PRELOAD imported, made once."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _child(rank: int, world_size: int, port: int, fn, args, conn, group_timeout: float) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=group_timeout))
        # Plain pickle copies tensors by value; multiprocessing's own pickler would pass them as
        # shared-memory handles that vanish when this process exits.
        message = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        message = ("error", traceback.format_exc())
    try:
        conn.send_bytes(pickle.dumps(message))
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, args: tuple = (), timeout: float = 300.0) -> list:
    """Run fn(rank, world_size, *args) on `world_size` gloo ranks; return the results ordered by rank."""
    ctx = rank_context()
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    group_timeout = max(0.8 * timeout, timeout - 30.0)
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, pipes[r][1], group_timeout))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for _, sender in pipes:
        sender.close()  # the child holds its own copy: a dead child now reads as end-of-file
    waiting = {pipes[r][0]: r for r in range(world_size)}
    results: dict[int, object] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while waiting:
        ready = multiprocessing.connection.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            if not errors:
                errors.append(f"ranks {sorted(waiting.values())} gave no result within {timeout:.0f} s")
            break
        for conn in ready:
            rank = waiting.pop(conn)
            try:
                status, payload = pickle.loads(conn.recv_bytes())
            except EOFError:
                procs[rank].join(timeout=5)
                status, payload = "exited", f"rank {rank} exited (code {procs[rank].exitcode}) without a result"
            if status == "ok":
                results[rank] = payload
                continue
            errors.append(payload if status == "exited" else f"rank {rank} failed:\n{payload}")
            # The other ranks are likely stuck waiting for this one: give them a moment to report, then stop.
            deadline = min(deadline, time.monotonic() + 2.0)
    for p in procs:
        p.join(timeout=5 if errors else timeout)
        if p.is_alive():
            p.kill()
            p.join()
    for receiver, _ in pipes:
        receiver.close()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
