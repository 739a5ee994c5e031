"""Process-group start-up and device choice: torchrun's environment in, (rank, world_size, device) out.

Launched by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set) this initialises NCCL on
GPUs or gloo on CPUs; run plainly it is a single process and creates no process group.

Restarts (torchrun --max-restarts): torchrun's c10d rendezvous keeps one TCP store alive for the whole job
and hands every attempt's workers the same MASTER_PORT, with no per-attempt key prefix. A restarted
worker's process group then finds the previous attempt's keys (gloo's peer addresses) and may connect to
a dead peer's port (`connectFullMesh ... Connection refused`) or wait on a stale counter. The process group
here therefore runs on that store under a prefix naming the attempt (TORCHELASTIC_RESTART_COUNT), so every
attempt starts from empty keys.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fourfold.config import DEVICES
from fourfold.errors import ConfigError


@dataclass
class DistEnv:
    """Where this process runs: its global rank, the world size and the torch device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0


def check_device(name: str, flag: str = "--compute.device", processes: int = 1) -> None:
    """Raise ConfigError, naming `flag`, unless device `name` can run `processes` local processes here."""
    if name not in DEVICES:
        raise ConfigError(f"{flag} '{name}' is not one of {', '.join(DEVICES)}; set {flag} to one of them.")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{flag} is 'cuda' but this machine has no usable CUDA GPU; use {flag} cpu (or auto).")
    gpus = torch.cuda.device_count() if name != "cpu" and torch.cuda.is_available() else 0
    if gpus and processes > gpus:
        raise ConfigError(f"--nproc {processes} starts one process per GPU on {flag} {name}, but this machine has "
                          f"{gpus}; lower --nproc to {gpus} or less, or use {flag} cpu.")


def pick_device(name: str, local_rank: int = 0, flag: str = "--compute.device") -> torch.device:
    """'auto' -> cuda:<local_rank> when CUDA is available, else cpu; 'cuda' without a GPU is an error naming `flag`."""
    check_device(name, flag)
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def world_from_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's variables, or (0, 1, 0) when not launched by it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    return rank, world, local


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (TORCHELASTIC_RESTART_COUNT; 0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def attempt_store(rank: int, world: int, timeout: timedelta) -> dist.Store | None:
    """The rendezvous store of this attempt under torchrun (keys prefixed by the attempt), or None outside it.

    Under torchrun's shared store (the default) every worker is a client of the agent's store; with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 rank 0 hosts a fresh one, as `env://` would.
    """
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or "MASTER_ADDR" not in os.environ:
        return None
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_store, timeout=timeout, multi_tenant=not agent_store)
    return dist.PrefixStore(f"fourfold/attempt_{restart_count()}", store)


def init_distributed(device_name: str = "auto", timeout_s: float = 1800.0) -> DistEnv:
    """Initialise torch.distributed if launched with several ranks; call after the layout is validated.

    `timeout_s` bounds every collective and the rendezvous (fault.timeout_s): a rank that stops answering
    fails the job after that long instead of stalling it for the backend's default.
    """
    rank, world, local = world_from_env()
    device = pick_device(device_name, local)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        timeout = timedelta(seconds=timeout_s)
        store = attempt_store(rank, world, timeout)
        if store is not None:
            kwargs["store"] = store
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return DistEnv(rank=rank, world_size=world, local_rank=local, device=device)


def shutdown() -> None:
    """Destroy the default process group, if one was initialised."""
    if dist.is_initialized():
        dist.destroy_process_group()
