"""Checkpoint benchmark: save and load time, the training stall of synchronous vs asynchronous saves, and peak
host and device memory while saving, for the llama-1b and llama3-8b presets on one GPU.

    python bench/checkpoint.py                                   # one H200: llama-1b and llama3-8b
    python bench/checkpoint.py --preset tiny --device cpu        # smoke check on a CPU
    python bench/checkpoint.py --dir /local/nvme/ckpt-bench      # where the checkpoints go (default: a temp dir)

Each preset runs in its own process: build fourfold's trainer (bf16 autocast, fp32 master weights, AdamW),
take a few training steps so the optimizer state exists (if AdamW state does not fit on the device, the
model alone is saved, and the result says so), then
  sync:  `Trainer.save` with checkpoint.async_save off: the stall is the whole save;
  async: `AsyncSaver.save` (the stall: copying this rank's state to host memory; skipped, and said so,
         when that copy would not fit in 80% of MemAvailable), then training steps run while the background thread writes; the step time during the save is reported next to the step
         time without one, and the save's own duration when it finishes;
  load:  `load_checkpoint` of the saved checkpoint into the same model and optimizer, with sha256
         verification of every file and with sizes only.
Peak host memory is the growth of the process's resident set (VmHWM after resetting it through
/proc/self/clear_refs) during each save; peak device memory the growth of torch's allocator peak.
Writes a JSON result (--json, default bench/results/checkpoint.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _host_peak_reset() -> int:
    """Reset the resident-set high-water mark (Linux); the current resident set in bytes (0 if unknown)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status("VmRSS")


def _status(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _Peaks:
    """Growth of host resident memory and of the device allocator's peak over a `with` block."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device

    def __enter__(self):
        self.host0 = _host_peak_reset()
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            self.dev0 = self.torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        self.host = max(0, _status("VmHWM") - self.host0)
        self.dev = 0
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
            self.dev = max(0, self.torch.cuda.max_memory_allocated() - self.dev0)


def _meminfo(key: str) -> int:
    """A /proc/meminfo entry in bytes (0 if unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file())


def run_one(preset: str, device: str, root: Path, steps_during: int, model_only: bool = False) -> dict:
    """Benchmark one preset in this process; the result record."""
    import torch

    from fourfold.checkpoint.async_save import AsyncSaver
    from fourfold.checkpoint.store import load_checkpoint, save_checkpoint
    from fourfold.config import build_config
    from fourfold.train.trainer import Trainer

    cuda = device == "cuda"
    flat = {"model.preset": preset, "train.seq_len": "256" if cuda else "32", "train.micro_batch": "1",
            "train.global_batch": "1", "compute.precision": "bf16" if cuda else "fp32", "compute.device": device,
            "optim.lr": "1e-4", "train.val_every": "0", "checkpoint.every": "0", "checkpoint.keep": "0",
            "checkpoint.save_final": "false", "log.progress": "false", "data.max_bytes": "2000000",
            "train.steps": "1000000"}
    cfg = build_config({}, flat)
    run = root / preset
    shutil.rmtree(run, ignore_errors=True)
    trainer = Trainer(cfg, run)
    sync = (lambda: torch.cuda.synchronize()) if cuda else (lambda: None)
    with_optimizer = not model_only  # --model-only: the trainer state would not fit the disk
    try:
        for _ in range(2 if with_optimizer else 0):
            trainer.train_step()
            trainer.step += 1
    except torch.cuda.OutOfMemoryError:
        with_optimizer = False
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.optimizer.state.clear()
        torch.cuda.empty_cache()
    optimizer = trainer.optimizer if with_optimizer else None
    modules = trainer.runner.checkpoint_modules

    def step_time(n: int) -> float:
        sync()
        begin = time.perf_counter()
        for _ in range(n):
            if with_optimizer:
                trainer.train_step()
            sync()
        return (time.perf_counter() - begin) / max(n, 1)

    baseline = step_time(steps_during) if with_optimizer else None
    meta = {"config": cfg.to_dict(), "data": trainer.train_batches.state_dict()}
    with _Peaks(torch, trainer.device) as sync_peak:
        begin = time.perf_counter()
        path = save_checkpoint(run, 1, modules, optimizer, meta, keep=0)
        sync_s = time.perf_counter() - begin
    size = _dir_bytes(path)

    stall = async_s = None
    during, n_during = 0.0, 0
    host_free = _meminfo("MemAvailable")
    async_skipped = size > 0.8 * host_free if host_free else False  # the host copy would not fit
    if not async_skipped:
        shutil.rmtree(path)  # one checkpoint on disk at a time (an 8B one with AdamW state is ~100 GB)
    with _Peaks(torch, trainer.device) as async_peak:
        if not async_skipped:
            saver = AsyncSaver()
            stall = saver.save(run, 2, modules, optimizer, meta, keep=0)
            while saver.pending and not saver.running_done() and with_optimizer and n_during < 1000:
                during += step_time(1)
                n_during += 1
            async_s = saver.wait()
            saver.close()
    load_from = run / "checkpoints" / ("step_1" if async_skipped else "step_2")

    loaded = {}
    for verify in (True, False):
        sync()
        begin = time.perf_counter()
        load_checkpoint(load_from, modules, optimizer, verify=verify)
        sync()
        loaded[verify] = time.perf_counter() - begin
    shutil.rmtree(run, ignore_errors=True)
    return {"preset": preset, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "optimizer_state": with_optimizer, "checkpoint_bytes": size, "host_available_bytes": host_free,
            "async_skipped_for_host_memory": async_skipped,
            "sync_save_s": sync_s, "sync_stall_s": sync_s,
            "async_stall_s": stall, "async_save_s": async_s,
            "step_s": baseline, "step_s_during_async_save": during / n_during if n_during else None,
            "steps_during_async_save": n_during,
            "load_verified_s": loaded[True], "load_sizes_only_s": loaded[False],
            "sync_peak_host_bytes": sync_peak.host, "sync_peak_device_bytes": sync_peak.dev,
            "async_peak_host_bytes": async_peak.host, "async_peak_device_bytes": async_peak.dev}


def _table(results: list[dict]) -> str:
    gib = 1 << 30
    head = ("preset", "ckpt GiB", "sync save s", "async stall s", "async save s", "step s", "step s (saving)",
            "load s", "load s (no sha)", "host GiB sync/async", "dev GiB sync/async")
    rows = [head]
    for r in results:
        def f(v, scale=1.0):
            return "-" if v is None else f"{v / scale:.2f}"
        rows.append((r["preset"] + ("" if r["optimizer_state"] else " (model only)"), f(r["checkpoint_bytes"], gib),
                     f(r["sync_save_s"]), f(r["async_stall_s"]), f(r["async_save_s"]), f(r["step_s"]),
                     f(r["step_s_during_async_save"]), f(r["load_verified_s"]), f(r["load_sizes_only_s"]),
                     f"{f(r['sync_peak_host_bytes'], gib)}/{f(r['async_peak_host_bytes'], gib)}",
                     f"{f(r['sync_peak_device_bytes'], gib)}/{f(r['async_peak_device_bytes'], gib)}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", help="model preset (repeatable; default llama-1b, llama3-8b)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--steps-during", type=int, default=3, help="steps timed for the step-time baseline")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "checkpoint.json"))
    parser.add_argument("--model-only", action="store_true",
                        help="save the model alone (no AdamW state), for presets whose trainer state exceeds the disk")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one preset, print JSON
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="fourfold-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.device, root, args.steps_during, args.model_only)), flush=True)
        return 0
    results = []
    for preset in args.preset or ["llama-1b", "llama3-8b"]:
        cmd = [sys.executable, __file__, "--one", preset, "--device", args.device, "--dir", str(root),
               "--steps-during", str(args.steps_during), *(["--model-only"] if args.model_only else [])]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            print(f"{preset}: failed (exit {out.returncode})\n{out.stderr[-3000:]}", file=sys.stderr)
            results.append({"preset": preset, "error": out.stderr[-2000:]})
            continue
        results.append(json.loads(lines[-1][len("RESULT "):]))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"results": results}, indent=1))
    ok = [r for r in results if "error" not in r]
    if ok:
        print(_table(ok))
    print(f"wrote {args.json}")
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
