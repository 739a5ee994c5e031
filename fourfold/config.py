"""Run configuration as dataclasses: loaded from TOML, overridden by dotted command-line keys, validated here.

    cfg = load_config("configs/tiny.toml", ["--train.steps", "100", "--model.dim", "256"])

Every field carries a docstring (the string under it); `describe()` turns them into the config reference.
Unknown keys and values of the wrong type raise `ConfigError` naming the key and the closest valid one.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, get_args, get_origin, get_type_hints

from fourfold.errors import ConfigError, closest
from fourfold.models.presets import PRESETS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


@dataclass
class ModelConfig:
    """The [model] section: the network's shape, optionally from a named preset."""

    preset: Optional[str] = None
    """Named shape from fourfold/models/presets.py; explicit keys in this section override it."""
    dim: int = 128
    """Hidden size."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention (query) heads."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide n_heads."""
    ffn_dim: int = 384
    """Inner size of the SwiGLU MLP."""
    vocab_size: int = 320
    """Embedding rows; at least the tokenizer's vocabulary."""
    max_seq_len: int = 256
    """Longest sequence the rotary table covers."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rope_scaling: Optional[dict] = None
    """Llama-3 frequency scaling: {factor, low_freq_factor, high_freq_factor, original_max_seq_len}, or none."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of linear and embedding weights."""

    @property
    def head_dim(self) -> int:
        """Size of one attention head: dim // n_heads."""
        return self.dim // self.n_heads


@dataclass
class ParallelConfig:
    """The [parallel] section: the parallel layout and how it shards and communicates."""

    dp: int = 1
    """Data-parallel replicas (gradients all-reduced)."""
    fsdp: int = 1
    """Data-parallel shards (parameters, gradients and optimizer state sharded, ZeRO-3)."""
    tp: int = 1
    """Tensor-parallel degree (attention heads and MLP columns split)."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context-parallel degree (sequence split, ring attention)."""
    vpp: int = 1
    """Virtual pipeline stages per rank (interleaved schedules)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved-1f1b or zero-bubble."""
    pp_microbatches: int = 0
    """Micro-batches per pipeline step; 0 derives it from train.global_batch / (micro_batch * dp * fsdp)."""
    sequence_parallel: bool = True
    """With tp > 1, shard norms and residuals along the sequence."""
    zero: int = 3
    """Sharding stage used when fsdp > 1: 1 (optimizer state), 2 (+gradients) or 3 (+parameters)."""
    bucket_mb: float = 25.0
    """DDP gradient bucket size in MiB (all-reduce overlapped with backward)."""
    hierarchical_allreduce: bool = False
    """DDP: reduce-scatter inside a node, all-reduce across nodes, all-gather inside the node."""
    gpus_per_node: int = 0
    """Ranks per node for HSDP and hierarchical all-reduce; 0 reads LOCAL_WORLD_SIZE."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (re-gather for backward)."""
    prefetch: int = 1
    """FSDP: blocks whose parameters are all-gathered ahead of use (forward and backward)."""
    max_inflight_allgathers: int = 2
    """FSDP: cap on parameter all-gathers in flight at once."""
    cpu_offload: bool = False
    """Keep sharded optimizer state (and parameters under FSDP) in CPU memory."""
    param_dtype: str = "fp32"
    """Dtype parameters are computed in under data parallel: fp32, bf16 or fp16 (fp32 master copies kept)."""
    reduce_dtype: str = "fp32"
    """Dtype gradients are reduced in: fp32, bf16 or fp16 (FSDP, or plain DDP through fourfold's low-precision comm hook)."""
    cp_method: str = "ring"
    """Context-parallel attention: ring (pass K/V around the ring) or allgather (gather K/V once)."""
    pp_layers: Optional[list] = None
    """Blocks per pipeline stage (pp * vpp entries summing to n_layers); unset splits evenly."""


@dataclass
class TrainConfig:
    """The [train] section: how long to train, on which batches, and how often to validate."""

    steps: int = 200
    """Optimizer steps."""
    global_batch: int = 16
    """Sequences per optimizer step, fixed whatever the layout."""
    micro_batch: int = 8
    """Sequences per forward per data-parallel rank; gradient accumulation is derived."""
    seq_len: int = 128
    """Tokens per sequence."""
    seed: int = 1234
    """Seed for initialisation and data order."""
    val_every: int = 50
    """Steps between validation passes; 0 disables."""
    val_batches: int = 4
    """Micro-batches per validation pass."""


@dataclass
class OptimConfig:
    """The [optim] section: AdamW, gradient clipping and the warmup + cosine learning-rate schedule."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine schedule floor as a fraction of lr."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables."""


@dataclass
class ComputeConfig:
    """The [compute] section: the device, numeric precision, compilation and activation recomputation."""

    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    precision: str = "fp32"
    """fp32, bf16 (autocast, fp32 master weights), fp16 (autocast with dynamic loss scaling), or fp64 (parity tests)."""
    compile: bool = False
    """torch.compile the model (see compile_scope)."""
    compile_scope: str = "blocks"
    """What one torch.compile covers: `blocks` (each transformer block; short compile, works with every
    layout) or `model` (the whole forward, so fusion crosses block boundaries; one GPU or DDP only)."""
    compile_memory_budget: float = 1.0
    """Compiled graphs: fraction of the activation memory the partitioner may keep for backward (torch's
    `activation_memory_budget`); below 1 it recomputes the cheapest activations to stay under it."""
    recompute: str = "none"
    """Activation recomputation: none, full, selective or every-N (e.g. every-2)."""
    loss_chunk: int = 0
    """Tokens per chunk of the cross-entropy (bounds fp32 logits memory); 0 computes it in one piece."""


@dataclass
class QuantConfig:
    """The [quant] section: low-precision training schemes."""

    float8: bool = False
    """float8 matmuls for the transformer blocks' linear layers (torchao, dynamic tensorwise scaling); needs
    compute.precision bf16, tp 1 and, on GPUs, compute capability 8.9+ (Hopper, Ada). See fourfold/quant/float8.py."""


@dataclass
class DataConfig:
    """The [data] section: text source, tokenizer, cache and validation split."""

    path: Optional[str] = None
    """Text file, directory or glob; unset trains on the Python standard library's own source."""
    tokenizer: str = "byte"
    """'byte' (no files needed) or the path of a Hugging Face tokenizer.json."""
    cache_dir: str = ".cache/fourfold"
    """Where tokenized corpora are memory-mapped, keyed by content and tokenizer."""
    val_fraction: float = 0.02
    """Fraction of sequences held out for validation."""
    max_bytes: int = 16_000_000
    """Read at most this many bytes of text from the source (0: no limit)."""


@dataclass
class CheckpointConfig:
    """The [checkpoint] section: when checkpoints are saved and how many are kept."""

    every: int = 100
    """Steps between checkpoints; 0 saves only at the end."""
    keep: int = 2
    """Keep the newest K checkpoints."""
    save_final: bool = True
    """Save a checkpoint after the last step."""


@dataclass
class LogConfig:
    """The [log] section: metric records, TensorBoard, progress bar and profiling."""

    every: int = 10
    """Steps between metric records."""
    tensorboard: bool = False
    """Also write TensorBoard events (needs the tb extra)."""
    progress: bool = True
    """Show the rich progress bar (rank 0)."""
    profile: bool = False
    """Record a torch.profiler trace of a few steps into the run directory."""


@dataclass
class Config:
    """A whole run's configuration, one dataclass per section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        """The config as nested plain dicts, one per section."""
        return dataclasses.asdict(self)


SECTIONS = get_type_hints(Config)


def _section_types(section_cls) -> dict[str, Any]:
    return get_type_hints(section_cls)


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Convert `value` (from TOML or a command-line string) to `typ`, or raise ConfigError naming `key`."""
    origin = get_origin(typ)
    if origin is not None and type(None) in get_args(typ):  # Optional[X]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        typ = next(a for a in get_args(typ) if a is not type(None))
    if isinstance(value, str) and typ is not str:
        if typ is bool:
            low = value.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ConfigError(f"{key} takes true or false, not '{value}'.")
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ConfigError(f"{key} takes a value of type {getattr(typ, '__name__', typ)}, not '{value}'.") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is list and isinstance(value, tuple):
        value = list(value)
    if typ in (int, float, str, bool, dict, list):
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ConfigError(f"{key} takes a value of type {typ.__name__}, not {value!r} ({type(value).__name__}).")
    return value


# Keys that moved out of [train] when it was split by what users set together (fourfold 0.2).
MOVED_KEYS = {
    **{f"train.{k}": f"optim.{k}" for k in ("lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1",
                                            "beta2", "eps", "grad_clip")},
    **{f"train.{k}": f"compute.{k}" for k in ("device", "precision", "compile", "compile_scope",
                                              "compile_memory_budget", "recompute", "loss_chunk")},
    "train.float8": "quant.float8",
}


def _split_key(dotted: str) -> tuple[str, str]:
    if dotted in MOVED_KEYS:
        raise ConfigError(f"'{dotted}' is now '{MOVED_KEYS[dotted]}' (the [train] section was split into [train], "
                          f"[optim], [compute] and [quant]); write --{MOVED_KEYS[dotted]}, or move the key to "
                          f"the [{MOVED_KEYS[dotted].split('.')[0]}] table of the config file.")
    parts = dotted.split(".")
    if len(parts) != 2:
        raise ConfigError(f"'{dotted}' is not a config key: keys look like section.name, e.g. train.steps.")
    section, name = parts
    if section not in SECTIONS:
        raise ConfigError(f"Unknown config section '{section}'.{closest(section, SECTIONS)} "
                          f"Sections: {', '.join(SECTIONS)}.")
    valid = _section_types(SECTIONS[section])
    if name not in valid:
        raise ConfigError(f"Unknown config key '{dotted}'.{closest(dotted, [f'{section}.{k}' for k in valid])} "
                          f"Keys of [{section}]: {', '.join(valid)}.")
    return section, name


def parse_overrides(args: list[str]) -> dict[str, str]:
    """Turn ['--train.steps', '100', '--a.b=c'] into {'train.steps': '100', 'a.b': 'c'}."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"Unexpected argument '{arg}': overrides look like --section.key value.")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"--{key} needs a value.")
            value = args[i + 1]
            i += 2
        out[key] = value
    return out


def build_config(sections: dict[str, dict] | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Build a validated Config from TOML-shaped `sections` and dotted `overrides` (later wins)."""
    raw: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for section, values in (sections or {}).items():
        if not isinstance(values, dict):
            raise ConfigError(f"'{section}' must be a [section] table in the config file.")
        for name, value in values.items():
            s, n = _split_key(f"{section}.{name}")
            raw[s][n] = value
    for dotted, value in (overrides or {}).items():
        s, n = _split_key(dotted)
        raw[s][n] = value

    preset = raw["model"].get("preset")
    if preset is not None and not (isinstance(preset, str) and preset.lower() in ("none", "")):
        if preset not in PRESETS:
            raise ConfigError(f"Unknown model preset '{preset}'.{closest(preset, PRESETS)} "
                              f"Presets: {', '.join(PRESETS)}.")
        raw["model"] = {**PRESETS[preset], **raw["model"]}

    built = {}
    for section, cls in SECTIONS.items():
        types = _section_types(cls)
        kwargs = {n: _coerce(f"{section}.{n}", v, types[n]) for n, v in raw[section].items()}
        built[section] = cls(**kwargs)
    cfg = Config(**built)
    validate(cfg)
    return cfg


def load_config(path: str | Path | None = None, args: list[str] | None = None) -> Config:
    """Load a TOML file (optional) and apply command-line overrides."""
    sections: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"Config file '{p}' does not exist. Presets live in configs/, e.g. configs/tiny.toml.")
        try:
            sections = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"Config file '{p}' is not valid TOML: {e}.") from None
    return build_config(sections, parse_overrides(args or []))


def _positive(cfg: Config, keys: list[str]) -> None:
    for dotted in keys:
        s, n = dotted.split(".")
        v = getattr(getattr(cfg, s), n)
        if v < 1:
            raise ConfigError(f"{dotted} must be at least 1, got {v}.")


PRECISIONS = ("fp32", "bf16", "fp16")
TRAIN_PRECISIONS = PRECISIONS + ("fp64",)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


def validate(cfg: Config) -> None:
    """Check values and combinations that need no world size; layout checks live in fourfold.mesh."""
    m, t, c = cfg.model, cfg.train, cfg.compute
    _positive(cfg, ["model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.ffn_dim",
                    "model.vocab_size", "model.max_seq_len", "train.steps", "train.global_batch",
                    "train.micro_batch", "train.seq_len", "parallel.dp", "parallel.fsdp", "parallel.tp",
                    "parallel.pp", "parallel.cp", "parallel.vpp"])
    if m.dim % m.n_heads:
        raise ConfigError(f"model.dim ({m.dim}) must be divisible by model.n_heads ({m.n_heads}).")
    if m.head_dim % 2:
        raise ConfigError(f"The head size model.dim / model.n_heads = {m.head_dim} must be even for rotary "
                          "embeddings; change model.dim or model.n_heads.")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads ({m.n_kv_heads}) must divide model.n_heads ({m.n_heads}).")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}); "
                          "lower train.seq_len or raise model.max_seq_len.")
    if c.precision not in TRAIN_PRECISIONS:
        raise ConfigError(f"compute.precision '{c.precision}' is not one of {', '.join(TRAIN_PRECISIONS)}."
                          f"{closest(c.precision, TRAIN_PRECISIONS)}")
    if c.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"compute.device '{c.device}' is not one of auto, cpu, cuda.")
    if not 0 < c.compile_memory_budget <= 1:
        raise ConfigError(f"compute.compile_memory_budget ({c.compile_memory_budget}) must be in (0, 1].")
    if c.compile_scope not in ("blocks", "model"):
        raise ConfigError(f"compute.compile_scope '{c.compile_scope}' is not one of blocks, model.")
    if cfg.quant.float8 and c.precision != "bf16":
        raise ConfigError(f"quant.float8 runs the block matmuls in float8 around a bf16 model; it needs "
                          f"--compute.precision bf16 (got {c.precision}), or set --quant.float8 false.")
    rc = c.recompute
    if not (rc in ("none", "full", "selective") or (rc.startswith("every-") and rc[6:].isdigit() and int(rc[6:]) > 0)):
        raise ConfigError(f"compute.recompute '{rc}' is not one of none, full, selective, every-N (N >= 1).")
    if cfg.parallel.pp_schedule not in PP_SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule '{cfg.parallel.pp_schedule}' is not one of "
                          f"{', '.join(PP_SCHEDULES)}.{closest(cfg.parallel.pp_schedule, PP_SCHEDULES)}")
    for key in ("param_dtype", "reduce_dtype"):
        if getattr(cfg.parallel, key) not in PRECISIONS:
            raise ConfigError(f"parallel.{key} '{getattr(cfg.parallel, key)}' is not one of {', '.join(PRECISIONS)}.")
    if cfg.parallel.cp_method not in ("ring", "allgather"):
        raise ConfigError(f"parallel.cp_method '{cfg.parallel.cp_method}' is not one of ring, allgather.")
    if cfg.parallel.zero not in (1, 2, 3):
        raise ConfigError(f"parallel.zero must be 1, 2 or 3, got {cfg.parallel.zero}.")
    if not 0.0 <= cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in [0, 1), got {cfg.data.val_fraction}.")
    if m.rope_scaling is not None:
        need = {"factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len"}
        missing = need - set(m.rope_scaling)
        if missing:
            raise ConfigError(f"model.rope_scaling lacks {', '.join(sorted(missing))}.")


def to_toml(cfg: Config) -> str:
    """Serialise a config as TOML (the run directory's config.toml); None values are left out."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            if v is None:
                continue
            lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} as TOML")


def describe() -> str:
    """The config reference as Markdown: every key, its default and its docstring."""
    import inspect

    out = []
    for section, cls in SECTIONS.items():
        out.append(f"### [{section}]\n\n| key | default | meaning |\n|---|---|---|")
        src = inspect.getsource(cls)
        docs = _field_docs(src)
        for f in fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            out.append(f"| `{section}.{f.name}` | `{default}` | {docs.get(f.name, '')} |")
        out.append("")
    return "\n".join(out)


def _field_docs(src: str) -> dict[str, str]:
    """Map field name -> the string literal that follows its declaration in a dataclass body."""
    tree = ast.parse(src)
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = str(b.value.value)
    return docs
