"""Pipeline timelines: bubble figures from timed actions, collection across ranks, Chrome traces, pictures.

    ideal = simulate([build_schedule("1f1b", 4, 1, 8, r) for r in range(4)])  # per-rank TimedActions
    records = gather_timelines(executor.last_timeline, executor.last_step_began, pp_group)  # measured
    measured_bubble(records[0])               # idle fraction of one rank's window
    pipeline_bubble(records)                  # idle time relative to ideal, comparable to analytic_bubble
    write_chrome_trace(records, "pp_trace.json")     # chrome://tracing or ui.perfetto.dev
    draw_timeline(records, "pp_timeline.png", "1f1b, pp=4, m=8")

Simulated times are abstract units; measured ones are seconds since the step began on that rank
(`gather_timelines` puts all ranks on one axis). Only compute actions (F, B, BI, BW) count as busy;
waiting in a send or receive is idle. matplotlib is imported only by `draw_timeline`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from fourfold.parallel.pipeline.schedules import TimedAction

COLOURS = {"F": "#4C78A8", "B": "#F58518", "BI": "#F58518", "BW": "#54A24B"}
"""Forward blue, backward (or backward for inputs) orange, backward for weights green; idle stays white."""


def _busy(records: list[TimedAction]) -> float:
    return sum(r.end - r.start for r in records if not r.action.is_comm)


def measured_bubble(records: list[TimedAction]) -> float:
    """Idle fraction of one rank's window (first action's start to last action's end): 1 - compute / window."""
    if not records:
        return 0.0
    window = max(r.end for r in records) - min(r.start for r in records)
    return 0.0 if window <= 0 else max(0.0, 1.0 - _busy(records) / window)


def pipeline_bubble(records_per_rank: list[list[TimedAction]]) -> float:
    """Whole step relative to the busiest rank's compute, minus one: the quantity `analytic_bubble` predicts."""
    records = [r for rank in records_per_rank for r in rank]
    busiest = max(_busy(rank) for rank in records_per_rank)
    span = max(r.end for r in records) - min(r.start for r in records)
    return span / busiest - 1.0


def gather_timelines(records: list[TimedAction], began: float, pp_group) -> list[list[TimedAction]]:
    """Every pp rank's timeline (a collective on `pp_group`; all ranks get the list, indexed by pp rank).

    `began` is the wall-clock time each rank's records count from (executor.last_step_began); the
    lists are shifted onto the earliest rank's origin so they share one time axis.
    """
    if pp_group is None:
        return [list(records)]
    gathered: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(gathered, (list(records), began), group=pp_group)
    origin = min(b for _, b in gathered)
    return [[TimedAction(r.action, r.start + b - origin, r.end + b - origin) for r in recs] for recs, b in gathered]


def write_chrome_trace(records_per_rank: list[list[TimedAction]], path: str | Path, time_unit: float = 1.0) -> Path:
    """Write a Chrome trace (JSON, one thread per pp rank); `time_unit` is the records' unit in seconds.

    Executor records are in seconds (the default); simulated records are in abstract units (pass
    e.g. time_unit=1e-3 to show a unit as a millisecond). Communication actions appear too
    (category "comm"), spanning from posting to completion.
    """
    events = []
    for rank, records in enumerate(records_per_rank):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"pp rank {rank}"}})
        for rec in records:
            a = rec.action
            events.append({
                "name": str(a), "cat": "comm" if a.is_comm else a.kind, "ph": "X", "pid": 0, "tid": rank,
                "ts": rec.start * time_unit * 1e6, "dur": max(0.0, rec.end - rec.start) * time_unit * 1e6,
                "args": {"microbatch": a.microbatch, "chunk": a.chunk, "peer": a.peer},
            })
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def draw_timeline(records_per_rank: list[list[TimedAction]], path_png: str | Path, title: str = "") -> Path:
    """Draw one row per pp rank: a box per compute action, coloured by kind, labelled with its micro-batch.

    Boxes of chunk c > 0 carry the chunk as a suffix ("3.1" = micro-batch 3 on chunk 1). Each row is
    labelled with its measured bubble. Needs matplotlib (pip install matplotlib, or the 'plot' extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:  # pragma: no cover - matplotlib is a test dependency
        raise ImportError("draw_timeline needs matplotlib: pip install matplotlib (or fourfold[plot]).") from e
    start = min((r.start for rank in records_per_rank for r in rank), default=0.0)
    end = max((r.end for rank in records_per_rank for r in rank), default=1.0)
    span = max(end - start, 1e-12)
    n = len(records_per_rank)
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, 0.25 * sum(len(r) for r in records_per_rank) / max(n, 1))),
                                    0.6 * n + 1.2))
    for rank, records in enumerate(records_per_rank):
        y = n - 1 - rank
        for rec in records:
            a = rec.action
            if a.is_comm:
                continue
            width = rec.end - rec.start
            ax.broken_barh([(rec.start - start, width)], (y - 0.4, 0.8), facecolors=COLOURS[a.kind],
                           edgecolors="black", linewidth=0.4)
            if width > span / 200:
                label = str(a.microbatch) if a.chunk == 0 else f"{a.microbatch}.{a.chunk}"
                ax.text(rec.start - start + width / 2, y, label, ha="center", va="center", fontsize=7,
                        color="white" if a.kind == "F" else "black")
    ax.set_yticks([n - 1 - r for r in range(n)])
    ax.set_yticklabels([f"rank {r}\n{measured_bubble(rec):.0%} idle" for r, rec in enumerate(records_per_rank)],
                       fontsize=8)
    ax.set_xlim(0, span)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlabel("time")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=COLOURS["F"], label="forward"), Patch(color=COLOURS["B"], label="backward"),
                       Patch(color=COLOURS["BW"], label="weight grad")], loc="upper right", fontsize=7, ncol=3)
    fig.tight_layout()
    path_png = Path(path_png)
    path_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path_png, dpi=120)
    plt.close(fig)
    return path_png
