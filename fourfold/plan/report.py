"""What the planner prints and writes: the ranked table, the overrides of a layout, a TOML `fourfold train` loads.

    console.print(ranked_table(ranked, world))
    print(" ".join(layout_overrides(cfg)))           # --parallel.tp 8 --parallel.pp 4 ...
    Path("best.toml").write_text(config_toml(cfg))   # load_config("best.toml") gives cfg back
"""

from __future__ import annotations

import dataclasses

from rich.table import Table

from fourfold.config import Config
from fourfold.hardware import device_kind, peak_memory_bytes
from fourfold.layout import data_parallel_strategy
from fourfold.plan.hardware import load_hardware
from fourfold.plan.predict import predict
from fourfold.plan.search import Ranked
from fourfold.units import format_bytes

PLANNED_KEYS = {
    "model": ("preset", "max_seq_len"),
    "train": ("seq_len", "global_batch", "micro_batch"),
    "parallel": ("dp", "fsdp", "tp", "pp", "cp", "vpp", "pp_schedule", "zero", "sequence_parallel", "param_dtype",
                 "cp_method"),
    "compute": ("device", "precision", "recompute", "compile", "compile_scope"),
    "quant": ("float8",),
}
"""The keys a plan sets, by section: what its overrides and its TOML carry."""


def describe(cfg: Config) -> str:
    """'tp8 pp4 (1f1b) fsdp2', the parallel part of a layout in a few characters."""
    p = cfg.parallel
    parts = [f"{name}{getattr(p, name)}" for name in ("tp", "cp", "pp") if getattr(p, name) > 1]
    if p.pp > 1:
        parts[-1] += f"x{p.vpp} {p.pp_schedule}" if p.vpp > 1 else f" {p.pp_schedule}"
    strategy = data_parallel_strategy(p)
    if p.dp > 1 and p.fsdp > 1:
        parts.append(f"hsdp {p.dp}x{p.fsdp}" + (f" zero{p.zero}" if p.zero != 3 else ""))
    elif p.fsdp > 1:
        parts.append(f"{'zero1' if strategy == 'zero1' else f'zero{p.zero}'} {p.fsdp}")
    elif p.dp > 1:
        parts.append(f"{'fsdp' if strategy == 'fsdp' else 'ddp'} {p.dp}")
    if p.tp > 1 and not p.sequence_parallel:
        parts.append("no-sp")
    return " ".join(parts) or "1 GPU"


def ranked_table(ranked: list[Ranked], world: int, title: str = "") -> Table:
    """The layouts, fastest first: layout, micro-batch, recompute, float8, step, tokens/s/GPU, MFU, memory."""
    table = Table(title=title or None, title_justify="left")
    for name, right in (("#", True), ("layout", False), ("micro", True), ("recompute", False), ("fp8", False),
                        ("step s", True), ("tokens/s/GPU", True), ("MFU", True), ("peak GiB", True),
                        ("needs GiB", True)):
        table.add_column(name, justify="right" if right else "left", no_wrap=name in ("layout", "recompute"))
    for i, r in enumerate(ranked, 1):
        pred = r.prediction
        table.add_row(str(i), describe(r.cfg), str(r.cfg.train.micro_batch), r.cfg.compute.recompute,
                      "yes" if r.cfg.quant.float8 else "", f"{pred.step.seconds:.4g}",
                      f"{pred.tokens_per_s_per_gpu:,.0f}", f"{pred.mfu:.1%}", f"{pred.peak_bytes / 2**30:.1f}",
                      f"{pred.needed_bytes / 2**30:.1f} / {pred.device_bytes / 2**30:.0f}")
    return table


def _planned(cfg: Config) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for section, keys in PLANNED_KEYS.items():
        values = getattr(cfg, section)
        out[section] = {k: getattr(values, k) for k in keys if getattr(values, k) is not None}
    return out


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


def layout_overrides(cfg: Config) -> list[str]:
    """The command-line overrides that run `cfg`'s planned keys: ['--parallel.tp', '8', ...]."""
    out = []
    defaults = Config()
    for section, values in _planned(cfg).items():
        for key, value in values.items():
            if key != "preset" and getattr(getattr(defaults, section), key) == value and section != "train":
                continue
            out += [f"--{section}.{key}", _value(value).strip('"')]
    return out


def config_toml(cfg: Config, header: str = "") -> str:
    """A TOML file with every planned key of `cfg` (model shape included unless it is a preset)."""
    lines = [f"# {line}" for line in header.splitlines()]
    planned = _planned(cfg)
    if cfg.model.preset is None:
        planned["model"] = {f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(cfg.model)
                            if getattr(cfg.model, f.name) is not None}
    for section, values in planned.items():
        lines += ["", f"[{section}]"] + [f"{k} = {_value(v)}" for k, v in values.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


def predicted_vs_measured(cfg: Config, world: int, device: str | None, step_seconds: float,
                          peak_bytes: int | None, gpus_per_node: int = 8) -> str:
    """One line for the end of a training run: the planner's step time and peak memory next to the measured.

    `device` is the hardware table's name ('h100', 'cpu'; None: unknown, no line); `peak_bytes` None leaves
    memory out (a CPU's resident set is not what the model predicts). Never raises: advice only."""
    if device is None:
        return "planner: no prediction (this GPU is not in the hardware table; add it with --hardware)"
    try:
        pred = predict(cfg, world, load_hardware(), device, gpus_per_node=min(world, gpus_per_node) or 1)
    except Exception as e:  # noqa: BLE001 - a layout the planner does not model must not fail a finished run
        return f"planner: no prediction ({e})"
    err = (pred.step.seconds - step_seconds) / step_seconds if step_seconds > 0 else 0.0
    line = f"planner: step {pred.step.seconds:.3f} s predicted, {step_seconds:.3f} s measured ({err:+.1%})"
    if peak_bytes:
        merr = (pred.peak_bytes - peak_bytes) / peak_bytes
        line += (f"; peak memory {format_bytes(pred.peak_bytes)} predicted, {format_bytes(peak_bytes)} measured "
                 f"({merr:+.1%})")
    return line


def end_of_run_line(cfg: Config, world: int, device, tokens_per_s: float | None) -> str:
    """`predicted_vs_measured` for a finished run on torch `device` at the measured `tokens_per_s` (all ranks)."""
    step = cfg.train.global_batch * cfg.train.seq_len / tokens_per_s if tokens_per_s else 0.0
    peak = peak_memory_bytes(device) if device.type == "cuda" else None
    return predicted_vs_measured(cfg, world, device_kind(device), step, peak)
