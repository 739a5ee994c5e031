"""`fourfold plan calibrate`: measure this machine's matmul rate, memory bandwidth and collective bandwidth.

    figures = measure(device="cpu")            # {'flops_fp32': ..., 'hbm_bandwidth': ..., 'link': {...}}
    write_calibration(figures, path)           # a hardware TOML that load_hardware() reads from then on

On CPUs: float32 (and bfloat16) matmuls, a large tensor copy, a gloo all-reduce between two local
processes, and the [cpu] table of fourfold/plan/calibrate_cpu.py (per-op costs, rates by call size, gloo
latency and bandwidth per collective) that the CPU step model reads. On a GPU: the same in bf16/fp32 on the GPU, and an NCCL all-reduce when two GPUs are visible.
The file holds one [device.NAME] table (NAME: "cpu", or the GPU kind such as "h100"), its in-node
[link.NAME] table and on CPUs the [cpu] table, which override the shipped figures for later predictions.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fourfold.plan.calibrate_cpu import cpu_table_toml, measure_cpu
from fourfold.plan.calibrate_reference import reference_table
from fourfold.plan.calibrate_gloo import gloo_table
from fourfold.plan.hardware import DTYPE_KEYS, load_hardware

GPU_KINDS = {"H200": "h200", "H100": "h100", "A100": "a100", "B200": "b200"}
TORCH_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Seconds per call of `fn`, after one warm-up call."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """Achieved FLOP/s of an n x n x n matmul in `dtype`."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _timed(lambda: a @ b, device, repeats)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a tensor copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), device, repeats)


def _allreduce_worker(rank: int, world: int, port: int, backend: str, nbytes: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    big = torch.ones(nbytes // 4, device=device)
    small = torch.ones(1, device=device)
    t_big = _timed(lambda: dist.all_reduce(big), device, 5)
    t_small = _timed(lambda: dist.all_reduce(small), device, 20)
    if rank == 0:
        out.put((t_big, t_small))
    dist.destroy_process_group()


def collective_bandwidth(backend: str, nbytes: int, world: int = 2) -> tuple[float, float]:
    """(bus bandwidth bytes/s, small-message latency s) of an all-reduce between `world` local processes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_allreduce_worker, args=(world, port, backend, nbytes, queue), nprocs=world,
                       start_method="spawn")
    t_big, t_small = queue.get(timeout=60)
    bus = 2 * (world - 1) / world * nbytes / max(t_big - t_small, 1e-9)
    return bus, t_small / (2 * (world - 1))


def measure(device: str = "auto", quick: bool = False) -> dict:
    """This machine's figures: device name, peak FLOP/s by dtype (measured), memory bandwidth, memory size,
    and the in-node link's bandwidth and latency (measured when two processes can run a collective)."""
    cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    dev = torch.device("cuda" if cuda else "cpu")
    n = (1024 if quick else 2048) if dev.type == "cpu" else 8192
    flops = {}
    for key in ("fp32", "bf16", "fp64") if dev.type == "cpu" else ("fp32", "bf16", "fp16"):
        flops[key] = matmul_rate(dev, TORCH_DTYPES[key], n if key != "fp64" else n // 2, repeats=3 if quick else 5)
    flops["tf32"] = flops["fp32"]
    flops.setdefault("fp16", flops["bf16"])
    flops.setdefault("fp64", flops["fp32"] / 2)
    nbytes = (64 if dev.type == "cpu" else 1024) * 2**20
    bandwidth = copy_bandwidth(dev, nbytes // (4 if quick else 1))
    if dev.type == "cuda":
        name = next((v for k, v in GPU_KINDS.items() if k in torch.cuda.get_device_name()), "local")
        memory = torch.cuda.get_device_properties(0).total_memory
        backend = "nccl" if torch.cuda.device_count() >= 2 else ""
    else:
        name = "cpu"
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        backend = "gloo"
    base = load_hardware(calibration=False)
    link_name = base.devices[name].intra_node if name in base.devices else ("measured" if backend else "nvlink4")
    link = {}
    if backend:
        bus, latency = collective_bandwidth(backend, (8 if dev.type == "cpu" else 256) * 2**20)
        link = {"name": link_name, "bandwidth": bus, "latency": latency}
    figures = {"name": name, "memory_gib": memory / 2**30, "hbm_bandwidth": bandwidth,
               **{f"flops_{k}": flops.get(k, 0.0) for k in DTYPE_KEYS}, "intra_node": link_name, "link": link}
    if dev.type == "cpu":
        table = {**measure_cpu(quick), **gloo_table(quick)}
        figures["cpu"] = {**table, **reference_table(table, 3 if quick else 5)}
    return figures


def write_calibration(figures: dict, path: Path) -> Path:
    """Write `figures` (from `measure`) as a hardware TOML at `path`; returns the path."""
    link = figures["link"]
    lines = ["# Written by `fourfold plan calibrate`: this machine's measured figures.",
             f"[device.{figures['name']}]", 'description = "measured by fourfold plan calibrate"',
             f"memory_gib = {figures['memory_gib']:.3f}"]
    lines += [f"flops_{k} = {figures[f'flops_{k}']:.6g}" for k in DTYPE_KEYS]
    lines += [f"hbm_bandwidth = {figures['hbm_bandwidth']:.6g}", f'intra_node = "{figures["intra_node"]}"']
    if link:
        lines += ["", f"[link.{link['name']}]", f"bandwidth = {link['bandwidth']:.6g}",
                  f"latency = {link['latency']:.6g}"]
    if figures.get("cpu"):
        lines += [""] + cpu_table_toml(figures["cpu"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
