"""`fourfold plan calibrate` on CPUs, the gloo part: two local processes time each collective, a DTensor linear and
an FSDP2 unit.

    figures = gloo_figures(repeats=7)   # {'all_reduce': (latency s, bandwidth bytes/s), ..., 'tp_linear': s, 'fsdp_unit': s}

Latency is the fastest call of an 8-byte message, bandwidth the bytes of a 4 MiB message over its time less
that latency (bytes counted as fourfold.plan.cpu_costs.COLLECTIVES says); send/receive is half a round trip.
"""

from __future__ import annotations

import os
import queue as queues
import socket
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fourfold.plan.calibrate_cpu import best_seconds
from fourfold.plan.cpu_costs import COLLECTIVES


def _gloo_worker(rank: int, port: int, repeats: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out = {}
    warnings.filterwarnings("ignore", category=FutureWarning)  # the *_tensor collectives' new names
    small, big = 8, 4 * 2**20
    for kind in COLLECTIVES:
        times = []
        for nbytes in (small, big):
            n = nbytes // 4
            x = torch.ones(n)
            out_t = torch.empty(2 * n)
            half = torch.empty(max(1, n // 2))
            calls = {
                "all_reduce": lambda: dist.all_reduce(x),
                "all_gather": lambda: dist.all_gather_into_tensor(out_t, x),
                "reduce_scatter": lambda: dist.reduce_scatter_tensor(half, x),
                "broadcast": lambda: dist.broadcast(x, 0),
                "p2p": lambda: (dist.send(x, 1), dist.recv(x, 1)) if rank == 0 else (dist.recv(x, 0), dist.send(x, 0)),
            }
            dist.barrier()
            t = best_seconds(calls[kind], repeats, 4 if nbytes == small else 1)
            times.append(t / 2 if kind == "p2p" else t)  # p2p: one way of the round trip
        # bytes convention of cpu_costs.COLLECTIVES: the whole tensor (all_gather's gathered output)
        moved = {"all_gather": 2 * big}.get(kind, big)
        out[kind] = (times[0], moved / max(times[1] - times[0], 1e-9))
    out["comm_factor"] = _in_step_factor(rank, repeats)
    out["tp_linear"] = _tp_linear(repeats)
    out["fsdp_unit"] = _fsdp_unit(repeats)
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def _in_step_factor(rank: int, repeats: int) -> float:
    """How much longer a collective takes inside a step than back to back: the median time of 1 MiB all-gathers,
    reduce-scatters and all-reduces each issued right after a few milliseconds of compute on both ranks (gloo's
    threads asleep, caches cold, ranks arriving a little apart) over the fastest of the same calls back to back."""
    n = 2**18
    x, gathered, half = torch.ones(n), torch.empty(2 * n), torch.empty(n // 2)
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    sweep = torch.empty(4 * 2**20)  # 16 MiB written between calls, as a step's other tensors are
    calls = (lambda: dist.all_gather_into_tensor(gathered, x), lambda: dist.reduce_scatter_tensor(half, x),
             lambda: dist.all_reduce(x))
    ratios = []
    for call in calls:
        dist.barrier()
        fastest = best_seconds(call, repeats, 1)
        times = []
        for _ in range(max(41, repeats)):
            for _ in range(6):
                a @ b
            sweep.fill_(1.0)
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        ratios.append(statistics.median(times) / fastest)
    return max(1.0, sum(ratios) / len(ratios))


def _tp_linear(repeats: int) -> float:
    """What a ColwiseParallel linear adds to a forward + backward over the same local plain linear."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(8, 32)
    tp = parallelize_module(nn.Sequential(nn.Linear(32, 32, bias=False)), mesh, {"0": ColwiseParallel()})
    plain = nn.Linear(32, 16, bias=False)
    t_tp = best_seconds(lambda: tp(x).sum().backward(), repeats, 2)
    t_plain = best_seconds(lambda: plain(x).sum().backward(), repeats, 2)
    return max(1e-7, t_tp - t_plain)


def _fsdp_unit(repeats: int) -> float:
    """What one FSDP2 unit (a block) adds to forward + backward over the same layers unsharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    units = 4
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(8, 16)
    plain = nn.Sequential(*(nn.Linear(16, 16, bias=False) for _ in range(units)))
    sharded = nn.Sequential(*(nn.Linear(16, 16, bias=False) for _ in range(units)))
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    t_fsdp = best_seconds(lambda: sharded(x).sum().backward(), repeats, 1)
    t_plain = best_seconds(lambda: plain(x).sum().backward(), repeats, 1)
    return max(1e-7, (t_fsdp - t_plain) / (units + 1))


def gloo_figures(repeats: int) -> dict:
    """Two local processes on gloo: per collective (latency s, bandwidth bytes/s), tp_linear, fsdp_unit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = mp.start_processes(_gloo_worker, args=(port, repeats, queue), nprocs=2, start_method="spawn", join=False)
    start = time.perf_counter()
    while time.perf_counter() - start < 600:
        try:
            figures = queue.get(timeout=1)
        except queues.Empty:
            try:
                procs.join(timeout=0.01)  # raises when a worker died
            except mp.ProcessExitedException as died:
                return _figures_despite(died, queue)
            continue
        try:
            procs.join()
        except mp.ProcessExitedException as died:  # after rank 0 reported: the figures are whole
            _warn_died_in_shutdown(died)
        return figures
    raise TimeoutError("the gloo calibration workers did not report within 600 s")


def _figures_despite(died: Exception, queue) -> dict:
    """A worker died before the parent read the figures: they count if rank 0 had already sent them (it sends
    only after every measurement, so a rank can only have died in the shutdown after it; gloo's threads have
    been seen to abort there on 2-core machines, "terminate called without an active exception"); else `died`."""
    try:
        figures = queue.get(timeout=5)
    except queues.Empty:
        raise died from None
    _warn_died_in_shutdown(died)
    return figures


def _warn_died_in_shutdown(died: Exception) -> None:
    warnings.warn(f"gloo calibration: a worker died while shutting down ({died}); its figures were in")


def gloo_table(quick: bool = False) -> dict:
    """The gloo keys of the [cpu] table: latency, bandwidth (in COLLECTIVES order), tp_linear, fsdp_unit,
    comm_factor."""
    gloo = gloo_figures(8 if quick else 30)
    return {"latency": [gloo[k][0] for k in COLLECTIVES], "bandwidth": [gloo[k][1] for k in COLLECTIVES],
            "tp_linear": gloo["tp_linear"], "fsdp_unit": gloo["fsdp_unit"], "comm_factor": gloo["comm_factor"]}
