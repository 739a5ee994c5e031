"""Accelerators, links and kernel efficiencies as data: the shipped table, user files on top, clear errors.

    hw = load_hardware()                                   # shipped table + the calibration file, if any
    hw = load_hardware(["my_cluster.toml"])                # + a user file (later files win, key by key)
    gpu, link = hw.device("h100"), hw.link("ib400")

The shipped table is `fourfold/plan/data/hardware.toml`; `fourfold plan calibrate` writes this machine's
measured figures to `calibration_path()` ($FOURFOLD_CALIBRATION, else ~/.cache/fourfold/calibration.toml),
which every later prediction reads. A file may hold any of [device.NAME], [link.NAME] and [efficiency]
tables, whole or in part, and a [cpu] table (fourfold/plan/cpu_costs.py: the CPU's per-op costs and gloo
figures); a missing key keeps the value below it, a wrong one raises ConfigError.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from fourfold.errors import ConfigError
from fourfold.plan.cpu_costs import CpuCosts, check_cpu_table, cpu_costs_from

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

SHIPPED = Path(__file__).parent / "data" / "hardware.toml"
DTYPE_KEYS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")


def calibration_path() -> Path:
    """Where `fourfold plan calibrate` stores this machine's figures (and where predictions read them)."""
    env = os.environ.get("FOURFOLD_CALIBRATION")
    return Path(env) if env else Path.home() / ".cache" / "fourfold" / "calibration.toml"


@dataclass(frozen=True)
class Device:
    """One accelerator: memory, dense peak FLOP/s by dtype, memory bandwidth, and its in-node link."""

    name: str
    description: str
    memory_gib: float
    flops_fp64: float
    flops_fp32: float
    flops_tf32: float
    flops_bf16: float
    flops_fp16: float
    flops_fp8: float
    hbm_bandwidth: float
    intra_node: str

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for 'fp64', 'fp32', 'tf32', 'bf16', 'fp16' or 'fp8' (0: not supported)."""
        return getattr(self, f"flops_{dtype}")

    @property
    def memory_bytes(self) -> float:
        """Usable device memory in bytes."""
        return self.memory_gib * 2**30


@dataclass(frozen=True)
class Link:
    """One interconnect: bandwidth per GPU and direction (bytes/s), one-way latency (s)."""

    name: str
    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the peaks fourfold reaches per op class (fitted to the recorded GPU runs)."""

    matmul: float
    """bf16/fp16/fp32 GEMMs, of the dtype's dense peak."""
    matmul_tokens_half: float
    """Tokens per micro-batch and rank at which GEMMs reach half of `matmul` (small micro-batches make skinny
    GEMMs): efficiency = matmul * T / (T + matmul_tokens_half)."""
    compile_block_boundary: float
    """Seconds per block and micro-batch that compiling block by block costs over compiling the whole model
    (graph boundaries between blocks)."""
    attention: float
    """Fused attention forward + backward, of the bf16 peak (causal FLOPs)."""
    fp8_matmul: float
    """float8 GEMMs (torchao dynamic scaling, casts included), of the fp8 peak."""
    elementwise_eager: float
    """Multiplier on the element-wise memory traffic model in eager mode (1 = the model's pass count)."""
    elementwise_compiled: float
    """Same, with torch.compile's fusions."""
    optimizer: float
    """Fused AdamW, of the memory bandwidth."""
    collective: float
    """NCCL bus bandwidth, of the link bandwidth."""
    overlap: float
    """Fraction of the compute that FSDP / DDP / ring communication can hide behind."""
    ring_attention: float
    """Ring attention's blocks take this many times the whole-sequence kernel's time (cuDNN blocks: 1.05)."""
    attention_seq_half: float
    """Sequence length (positions per rank) at which attention reaches half of `attention` (short
    sequences launch small tiles): efficiency = attention * s / (s + attention_seq_half)."""
    allgather_attention: float
    """All-gather context parallel's attention (explicit causal mask) takes this many times the fused kernel."""
    comm_exposed: float
    """Least fraction of DDP's all-reduce and FSDP's gathers/reduce-scatters that stays exposed (measured on
    one NVLink node: almost all, the collectives slow the overlapping kernels)."""
    decode_bandwidth: float
    """Fraction of the memory bandwidth a decode step reaches reading weights and KV cache (not measured)."""
    pp_action_overhead: float
    """Seconds each pipeline compute action adds (the executor's dispatch, send/receive posting, waits)."""
    tp_block_overhead: float
    """Seconds per block and micro-batch that eager DTensor tensor parallel adds (dispatch, redistribution)."""
    tp_sp_block_overhead: float
    """Same, with sequence parallel."""


@dataclass(frozen=True)
class Hardware:
    """Every device, link and efficiency known, after the user's files."""

    devices: dict[str, Device]
    links: dict[str, Link]
    efficiency: Efficiency
    sources: tuple[str, ...]
    cpu: CpuCosts | None = None
    """The CPU's measured per-op costs and gloo figures ([cpu] table), used when the device is 'cpu'."""

    def device(self, name: str) -> Device:
        """The device called `name`, or a ConfigError listing the known ones."""
        if name.lower() not in self.devices:
            raise ConfigError(f"Unknown device '{name}'. Known: {', '.join(self.devices)}; add a [device.{name}] "
                              "table to a --hardware file to plan for another one.")
        return self.devices[name.lower()]

    def link(self, name: str) -> Link:
        """The link called `name`, or a ConfigError listing the known ones."""
        if name.lower() not in self.links:
            raise ConfigError(f"Unknown interconnect '{name}'. Known: {', '.join(self.links)}; add a [link.{name}] "
                              "table to a --hardware file for another one.")
        return self.links[name.lower()]


def _read(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"Hardware file '{path}' does not exist; give a TOML file with [device.NAME], "
                          "[link.NAME] or [efficiency] tables (see fourfold/plan/data/hardware.toml).") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as e:
        raise ConfigError(f"Hardware file '{path}' is not valid TOML ({e}); fix that line.") from None


def _check_value(where: str, key: str, value, kind: type):
    if kind is str:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: '{key}' must be a non-empty string, not {value!r}.")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: '{key}' must be a number, not {value!r}.")
    if value < 0 or (value == 0 and key not in ("flops_fp8", "latency") and not key.startswith("flops_")):
        raise ConfigError(f"{where}: '{key}' = {value!r} must be positive (FLOP/s, bytes/s, seconds or GiB).")
    if kind is Efficiency and not 0 < value <= (1e6 if key.endswith("_half") else 4):
        raise ConfigError(f"{where}: efficiency '{key}' = {value!r} must be in (0, 4] (a fraction of the peak).")
    return float(value)


def _merge(table: dict, raw: dict, cls, where: str) -> dict:
    """Apply `raw` (one file's tables of one kind) over `table` (name -> field dict), checking every key."""
    names = [f.name for f in fields(cls) if f.name != "name"]
    out = {k: dict(v) for k, v in table.items()}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table of tables.")
    for name, values in raw.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{where}.{name} must be a table of key = value lines.")
        entry = out.setdefault(name.lower(), {})
        for key, value in values.items():
            if key not in names:
                raise ConfigError(f"{where}.{name}: unknown key '{key}'. Keys: {', '.join(names)}.")
            kind = str if key in ("description", "intra_node") else float
            entry[key] = _check_value(f"{where}.{name}", key, value, kind)
        missing = [k for k in names if k not in entry]
        if missing:
            raise ConfigError(f"{where}.{name} is new, so it needs every key; missing: {', '.join(missing)}.")
    return out


def load_hardware(paths: list[str | Path] | None = None, calibration: bool = True,
                  efficiency: dict | None = None) -> Hardware:
    """The shipped table, then the calibration file (if present and `calibration`), then each of `paths`,
    then `efficiency` (key -> value over the [efficiency] table)."""
    files = [SHIPPED]
    if calibration and calibration_path().is_file():
        files.append(calibration_path())
    files += [Path(p) for p in paths or []]
    devices: dict = {}
    links: dict = {}
    eff: dict = {}
    cpu: dict = {}
    for path in files:
        data = _read(path)
        unknown = set(data) - {"device", "link", "efficiency", "cpu"}
        if unknown:
            raise ConfigError(f"Hardware file '{path}': unknown table(s) {', '.join(sorted(unknown))}; use "
                              "[device.NAME], [link.NAME], [efficiency] and [cpu].")
        cpu.update(check_cpu_table(data.get("cpu", {}), f"{path}: cpu"))
        devices = _merge(devices, data.get("device", {}), Device, f"{path}: device")
        links = _merge(links, data.get("link", {}), Link, f"{path}: link")
        for key, value in data.get("efficiency", {}).items():
            if key not in [f.name for f in fields(Efficiency)]:
                raise ConfigError(f"{path}: efficiency: unknown key '{key}'. Keys: "
                                  f"{', '.join(f.name for f in fields(Efficiency))}.")
            eff[key] = _check_value(f"{path}: efficiency", key, value, Efficiency)
    for key, value in (efficiency or {}).items():
        eff[key] = _check_value("efficiency override", key, value, Efficiency)
    built_links = {n: Link(name=n, **v) for n, v in links.items()}
    built = {}
    for n, v in devices.items():
        if v["intra_node"] not in built_links:
            raise ConfigError(f"device.{n}: intra_node '{v['intra_node']}' names no [link.*] table; known: "
                              f"{', '.join(built_links)} (hardware files read: {', '.join(map(str, files))}).")
        built[n] = Device(name=n, **v)
    sources = tuple(str(f) for f in files)
    return Hardware(built, built_links, Efficiency(**eff), sources, cpu_costs_from(cpu, f"[cpu] of {', '.join(sources)}"))
