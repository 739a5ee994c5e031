"""Training metrics: JSON-lines records, optional TensorBoard, and the rich console progress bar.

Only rank 0 creates a writer; `metrics.jsonl` holds one JSON object per record with `step`, `loss`,
`lr`, `grad_norm`, `tokens_per_s`, `mfu`, `peak_mem_bytes`, `skipped_steps` (validation records carry
`val_loss` and `val_ppl`).

One history per run directory: a writer opened at step N (a resumed run, or N = 0 for a new one) first drops
the records of steps after N, which the run is about to redo, and any line a crash cut short; the rewrite
goes to a temporary file renamed over the old one, so a crash leaves either file whole. TensorBoard
events of those steps are purged the same way (`purge_step`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from fourfold.units import format_bytes


class MetricsWriter:
    """Appends records to run_dir/metrics.jsonl and, if asked and installed, TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, console: Console | None = None,
                 start_step: int = 0):
        self.path = Path(run_dir) / "metrics.jsonl"
        drop_records_after(self.path, start_step)
        self.file = open(self.path, "a", buffering=1)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                (console or Console(stderr=True)).print(
                    "[yellow]log.tensorboard is on but tensorboard is not installed "
                    "(pip install 'fourfold[tb]'); writing metrics.jsonl only.[/]")
            else:
                self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=start_step + 1)

    def write(self, record: dict) -> None:
        """Append one record (non-finite floats become null), and its numbers to TensorBoard when enabled."""
        clean = {k: _json_number(v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        if self.tb is not None:
            for key, value in clean.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, clean["step"])

    def close(self) -> None:
        """Close metrics.jsonl and the TensorBoard writer."""
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def _json_number(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def drop_records_after(path: Path, step: int) -> None:
    """Keep only the records of `path` (a metrics.jsonl) at steps <= `step`, and whole lines; atomically."""
    path = Path(path)
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(record, dict) and record.get("step", 0) <= step:
            kept.append(line + "\n")
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with open(partial, "w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def read_metrics(run_dir: Path) -> list[dict]:
    """All records of a run directory's metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class TrainProgress:
    """A rich progress bar with ETA and the live loss, tokens/s, MFU and memory; disabled off rank 0."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool, console: Console):
        self.enabled = enabled
        self.console = console
        if not enabled:
            return
        self.progress = Progress(
            TextColumn("[bold]train[/]"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
            console=console, transient=False, refresh_per_second=4,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, info="")
        self.progress.start()

    def update(self, step: int, record: dict | None = None) -> None:
        """Move the bar to `step`; with a record, show its loss, tokens/s, MFU and peak memory."""
        if not self.enabled:
            return
        info = None
        if record is not None:
            parts = [f"loss {record['loss']:.4f}", f"{record['tokens_per_s']:,.0f} tok/s"]
            if record.get("mfu") is not None:
                parts.append(f"MFU {100 * record['mfu']:.1f}%")
            parts.append(f"mem {format_bytes(record.get('peak_mem_bytes'))}")
            info = "  ".join(parts)
        kwargs = {"info": info} if info is not None else {}
        self.progress.update(self.task, completed=step, **kwargs)

    def log(self, text: str) -> None:
        """Print a line through the progress bar's console (nothing when disabled)."""
        if self.enabled:
            self.progress.console.print(text)

    def close(self) -> None:
        """Stop the progress bar."""
        if self.enabled:
            self.progress.stop()
