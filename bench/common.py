"""Shared plumbing for the benchmarks: run variants in subprocesses (torchrun for several GPUs), time steps,
build fourfold's real training step from config overrides, and print the side-by-side table.

A variant is timed by calling its step function `warmup` times, then `steps` times between two CUDA
synchronisations; every rank runs the same steps and rank 0 reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def time_calls(owner, name: str, totals: dict, key: str, clock=time.perf_counter, counts: dict | None = None) -> None:
    """Replace `owner.name` by a wrapper that adds each call's `clock()` time to totals[key] (and 1 to counts[key])."""
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[key] += clock() - t0
            if counts is not None:
                counts[key] += 1
    setattr(owner, name, timed)


def fourfold_step(preset: str, micro_batch: int, seq: int, overrides: dict, global_batch: int | None = None):
    """fourfold's `Trainer.train_step` for the given overrides (data, loss, clip and optimizer included).

    The learning rate is the peers' (1e-4): the config's default (3e-3, sized for the tiny CPU model)
    makes the large presets diverge, which does not change a step's time but spoils the reported loss.
    """
    from fourfold.config import build_config
    from fourfold.train.trainer import Trainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    flat = {"model.preset": preset, "train.seq_len": str(seq), "train.micro_batch": str(micro_batch),
            "train.global_batch": str(global_batch or micro_batch * world), "compute.precision": "bf16",
            "compute.device": "cuda", "optim.lr": "1e-4", "train.val_every": "0", "checkpoint.every": "0",
            "checkpoint.save_final": "false", "log.progress": "false", "data.max_bytes": "8000000"}
    flat.update({k: str(v) for k, v in overrides.items()})
    cfg = build_config({}, flat)
    out = os.environ.get("FOURFOLD_BENCH_DIR") or tempfile.mkdtemp(prefix="fourfold-bench-")
    trainer = Trainer(cfg, out)

    def step():
        """Run one trainer step; return its loss."""
        loss, _, _ = trainer.train_step()
        return loss

    return step, cfg, trainer


def time_steps(step, warmup: int, steps: int) -> tuple[float, float]:
    """(seconds per step, last loss) after `warmup` untimed steps; peak memory is reset after warm-up."""
    import torch

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    loss = None
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps, float(loss) if loss is not None else float("nan")


def figures(name: str, model_cfg, seq: int, tokens_per_step_global: int, sec_per_step: float, loss: float,
            world: int) -> dict:
    """The row a variant reports: tokens/s (global and per GPU), MFU, peak memory of this rank."""
    import torch

    from fourfold.hardware import peak_flops
    from fourfold.models.llama import training_flops_per_token

    tps = tokens_per_step_global / sec_per_step
    peak = peak_flops(torch.device("cuda"))
    mfu = training_flops_per_token(model_cfg, seq) * tps / (peak * world) if peak else None
    return {"variant": name, "gpus": world, "tokens_per_s": tps, "tokens_per_s_per_gpu": tps / world,
            "step_ms": 1000 * sec_per_step, "mfu": mfu, "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
            "loss": loss, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def report(row: dict) -> None:
    """Rank 0 prints the row as one RESULT line the parent process parses."""
    if int(os.environ.get("RANK", "0")) == 0:
        print("RESULT " + json.dumps(row), flush=True)


def run_variant_process(script: str, name: str, nproc: int, extra_args: list[str], timeout: int = 900,
                        extra_env: dict[str, str] | None = None) -> dict:
    """Run `script --one name` in a fresh process (under torchrun when nproc > 1); return its RESULT row.

    `extra_env` adds environment variables for that process alone (e.g. NCCL settings a variant tries).
    """
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               script, "--one", name, *extra_args]
    else:
        cmd = [sys.executable, script, "--one", name, *extra_args]
    env = {**os.environ, **(extra_env or {}), "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"variant": name, "gpus": nproc, "error": f"timed out after {timeout}s"}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return {"variant": name, "gpus": nproc, "error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(line[len("RESULT "):])


def print_table(rows: list[dict], baseline: dict[str, str] | None = None, extra: tuple[str, ...] = ()) -> None:
    """Print rows; `baseline` maps a variant to the peer it is compared with (ratio of tokens/s per GPU)."""
    by_name = {r["variant"]: r for r in rows if "error" not in r}
    head = f"{'variant':36s} {'gpus':>4s} {'tok/s/gpu':>10s} {'MFU':>7s} {'peak GiB':>9s} {'ratio':>8s}"
    print("\n" + head + "".join(f" {e:>10s}" for e in extra))
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:36s} {r.get('gpus', ''):>4} FAILED: {r['error'][-300:]!r}")
            continue
        peer = by_name.get((baseline or {}).get(r["variant"], ""))
        if peer:
            r["ratio_vs_peer"] = r["tokens_per_s_per_gpu"] / peer["tokens_per_s_per_gpu"]
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        ratio = f"{r['ratio_vs_peer']:.3f}" if "ratio_vs_peer" in r else "-"
        cols = "".join(f" {r.get(e, ''):>10.4g}" if isinstance(r.get(e), (int, float)) else f" {'-':>10s}" for e in extra)
        print(f"{r['variant']:36s} {r['gpus']:>4d} {r['tokens_per_s_per_gpu']:10,.0f} {mfu:>7s} "
              f"{r['peak_mem_gib']:9.1f} {ratio:>8s}{cols}")


def save(path: str, args, rows: list[dict]) -> None:
    """Write the run's arguments and result rows to `path` as JSON."""
    with open(path, "w") as f:
        json.dump({"args": vars(args), "results": rows}, f, indent=2)


def read_child(proc, name: str, timeout: float, kill, on_row, say=print) -> tuple[list[dict], list[str]]:
    """Read a variant's child process line by line until it exits or `timeout` seconds pass (then `kill()` it).

    `RESULT {json}` lines become rows (each passed to `on_row`, which may annotate it and print a line),
    `PROGRESS text` lines are echoed through `say`; returns (rows, the last 40 lines) once the child exited.
    """
    import selectors

    rows, tail, start = [], [], time.perf_counter()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while True:
            if time.perf_counter() - start > timeout:
                kill()
                rows.append({"variant": name, "error": f"timed out after {timeout:.0f}s"})
                break
            if not sel.select(timeout=1.0):
                continue
            line = proc.stdout.readline()
            if not line:
                break
            line = line.rstrip()
            tail = (tail + [line])[-40:]
            if line.startswith("RESULT "):
                row = json.loads(line[7:])
                on_row(row)
                rows.append(row)
            elif line.startswith("PROGRESS "):
                say("   " + line[9:])
    finally:
        proc.wait()
    return rows, tail


def write_doc_block(doc_path: str, begin: str, end: str, text: str) -> None:
    """Replace what stands between the markers `begin` and `end` in `doc_path` with `text` (a missing file or
    marker leaves the file alone)."""
    if not os.path.exists(doc_path):
        return
    doc = open(doc_path).read()
    if begin in doc and end in doc:
        doc = doc[:doc.index(begin) + len(begin)] + "\n" + text + "\n" + doc[doc.index(end):]
        open(doc_path, "w").write(doc)
