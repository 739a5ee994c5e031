"""Run configuration as dataclasses: loaded from TOML, overridden by dotted command-line keys, validated here.

    cfg = load_config("configs/tiny.toml", ["--train.steps", "100", "--model.dim", "256"])

Every field carries a docstring (the string under it) and, where it has one, its valid range declared
beside it (`lr: float = setting(3e-3, gt=0)`, fourfold.settings); `fourfold.config_text.describe()` turns
both into the config reference and `validate` checks every range in one loop (non-finite floats are never valid). Unknown keys, values of the
wrong type and values out of range raise `ConfigError` naming the key, the flag and what it accepts.
Rules about the parallel layout (which need the world size) live in fourfold.layout.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, get_args, get_origin, get_type_hints

from fourfold.errors import ConfigError, closest
from fourfold.models.presets import PRESETS
from fourfold.settings import Range, field_docs, setting

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

PRECISIONS = ("fp32", "bf16", "fp16")
TRAIN_PRECISIONS = PRECISIONS + ("fp64",)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
CP_METHODS = ("ring", "allgather")
DEVICES = ("auto", "cpu", "cuda")
COMPILE_SCOPES = ("blocks", "model")
DATA_FORMATS = ("auto", "text", "jsonl")


@dataclass
class ModelConfig:
    """The [model] section: the network's shape, optionally from a named preset."""

    preset: Optional[str] = None
    """Named shape from fourfold/models/presets.py; explicit keys in this section override it."""
    dim: int = setting(128, ge=1)
    """Hidden size."""
    n_layers: int = setting(4, ge=1)
    """Number of transformer blocks."""
    n_heads: int = setting(4, ge=1)
    """Attention (query) heads."""
    n_kv_heads: int = setting(2, ge=1)
    """Key/value heads (grouped-query attention); must divide n_heads."""
    ffn_dim: int = setting(384, ge=1)
    """Inner size of the SwiGLU MLP."""
    vocab_size: int = setting(320, ge=1)
    """Embedding rows; at least the tokenizer's vocabulary."""
    max_seq_len: int = setting(256, ge=1)
    """Longest sequence the rotary table covers."""
    rope_theta: float = setting(10000.0, gt=0)
    """Rotary embedding base."""
    rope_scaling: Optional[dict] = None
    """Llama-3 frequency scaling: {factor, low_freq_factor, high_freq_factor, original_max_seq_len}, or none."""
    norm_eps: float = setting(1e-5, gt=0)
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head."""
    init_std: float = setting(0.02, ge=0)
    """Standard deviation of the normal initialisation of linear and embedding weights."""
    head_size: int = setting(0, ge=0)
    """Size of one attention head; 0 derives dim // n_heads (imported models may set another, e.g. Gemma-style)."""
    attention_bias: bool = False
    """Biases on the q, k, v and output projections of attention (Hugging Face's attention_bias)."""
    mlp_bias: bool = False
    """Biases on the three SwiGLU projections (Hugging Face's mlp_bias)."""

    @property
    def head_dim(self) -> int:
        """Size of one attention head: head_size when set, else dim // n_heads."""
        return self.head_size or self.dim // self.n_heads


@dataclass
class ParallelConfig:
    """The [parallel] section: the parallel layout and how it shards and communicates."""

    dp: int = setting(1, ge=1)
    """Data-parallel replicas (gradients all-reduced)."""
    fsdp: int = setting(1, ge=1)
    """Data-parallel shards (parameters, gradients and optimizer state sharded, ZeRO-3)."""
    tp: int = setting(1, ge=1)
    """Tensor-parallel degree (attention heads and MLP columns split)."""
    pp: int = setting(1, ge=1)
    """Pipeline stages."""
    cp: int = setting(1, ge=1)
    """Context-parallel degree (sequence split, ring attention)."""
    vpp: int = setting(1, ge=1)
    """Virtual pipeline stages per rank (interleaved schedules)."""
    pp_schedule: str = setting("1f1b", choices=PP_SCHEDULES)
    """Pipeline schedule: gpipe, 1f1b, interleaved-1f1b or zero-bubble."""
    pp_microbatches: int = setting(0, ge=0)
    """Micro-batches per pipeline step; 0 derives it from train.global_batch / (micro_batch * dp * fsdp)."""
    sequence_parallel: bool = True
    """With tp > 1, shard norms and residuals along the sequence."""
    zero: int = setting(3, choices=(1, 2, 3))
    """Sharding stage used when fsdp > 1: 1 (optimizer state only; needs dp = tp = cp = 1), 2 (+gradients) or 3
    (+parameters)."""
    bucket_mb: float = setting(25.0, gt=0)
    """DDP gradient bucket size in MiB (all-reduce overlapped with backward)."""
    hierarchical_allreduce: bool = False
    """DDP (dp alone): reduce-scatter inside a node, all-reduce across nodes, all-gather inside the node."""
    gpus_per_node: int = setting(0, ge=0)
    """Ranks per node for HSDP and hierarchical all-reduce; 0 reads LOCAL_WORLD_SIZE."""
    reshard_after_forward: bool = True
    """FSDP: free gathered parameters after forward (re-gather for backward)."""
    prefetch: int = setting(1, ge=0)
    """FSDP: blocks whose parameters are all-gathered ahead of use (forward and backward)."""
    max_inflight_allgathers: int = setting(2, ge=0)
    """FSDP: cap on parameter all-gathers in flight at once."""
    cpu_offload: bool = False
    """FSDP: keep the sharded parameters, gradients and optimizer state in CPU memory."""
    param_dtype: str = setting("fp32", choices=PRECISIONS)
    """Dtype parameters are computed in under data parallel: fp32, bf16 or fp16 (fp32 master copies kept)."""
    reduce_dtype: str = setting("fp32", choices=PRECISIONS)
    """Dtype gradients are reduced in: fp32, bf16 or fp16 (FSDP, or plain DDP through fourfold's low-precision comm hook)."""
    cp_method: str = setting("ring", choices=CP_METHODS)
    """Context-parallel attention: ring (pass K/V around the ring) or allgather (gather K/V once)."""
    pp_layers: Optional[list] = None
    """Blocks per pipeline stage (pp * vpp entries summing to n_layers); unset splits evenly."""


@dataclass
class TrainConfig:
    """The [train] section: how long to train, on which batches, and how often to validate."""

    steps: int = setting(200, ge=1)
    """Optimizer steps."""
    global_batch: int = setting(16, ge=1)
    """Sequences per optimizer step, fixed whatever the layout."""
    micro_batch: int = setting(8, ge=1)
    """Sequences per forward per data-parallel rank; gradient accumulation is derived."""
    seq_len: int = setting(128, ge=1)
    """Tokens per sequence."""
    seed: int = setting(1234, ge=0, lt=2**63)
    """Seed for initialisation and data order."""
    val_every: int = setting(50, ge=0)
    """Steps between validation passes; 0 disables."""
    val_batches: int = setting(4, ge=0)
    """Micro-batches per validation pass."""
    max_bad_steps: int = setting(20, ge=0)
    """Stop after this many skipped steps in a row (a step whose loss or gradient norm is NaN/inf is skipped on
    every rank); 0 never stops. fp16's loss scaler skips a few steps while it backs off, so keep it above ~16."""


@dataclass
class OptimConfig:
    """The [optim] section: AdamW, gradient clipping and the warmup + cosine learning-rate schedule."""

    lr: float = setting(3e-3, gt=0)
    """Peak learning rate."""
    min_lr_ratio: float = setting(0.1, ge=0, le=1)
    """Cosine schedule floor as a fraction of lr."""
    warmup_steps: int = setting(20, ge=0)
    """Linear warmup steps."""
    weight_decay: float = setting(0.1, ge=0)
    """AdamW decoupled weight decay (not applied to norms)."""
    beta1: float = setting(0.9, ge=0, lt=1)
    """AdamW beta1."""
    beta2: float = setting(0.95, ge=0, lt=1)
    """AdamW beta2."""
    eps: float = setting(1e-8, gt=0)
    """AdamW epsilon, added to the update's denominator; above 0 so a parameter whose gradient stays zero gets no 0/0."""
    grad_clip: float = setting(1.0, ge=0)
    """Clip the global gradient norm to this; 0 disables."""


@dataclass
class ComputeConfig:
    """The [compute] section: the device, numeric precision, compilation and activation recomputation."""

    device: str = setting("auto", choices=DEVICES)
    """auto (cuda when available), cpu or cuda."""
    precision: str = setting("fp32", choices=TRAIN_PRECISIONS)
    """fp32, bf16 (autocast, fp32 master weights), fp16 (autocast with dynamic loss scaling), or fp64 (parity tests)."""
    compile: bool = False
    """torch.compile the model (see compile_scope)."""
    compile_scope: str = setting("blocks", choices=COMPILE_SCOPES)
    """What one torch.compile covers: `blocks` (each transformer block; short compile, works with every
    layout) or `model` (the whole forward, so fusion crosses block boundaries; one GPU or DDP only)."""
    compile_memory_budget: float = setting(1.0, gt=0, le=1)
    """Compiled graphs: fraction of the activation memory the partitioner may keep for backward (torch's
    `activation_memory_budget`); below 1 it recomputes the cheapest activations to stay under it."""
    recompute: str = "none"
    """Activation recomputation: none, full, selective or every-N (e.g. every-2)."""
    loss_chunk: int = setting(0, ge=0)
    """Tokens per chunk of the cross-entropy (bounds fp32 logits memory); 0 computes it in one piece."""


# Names of the quantization schemes (fourfold.quant.schemes.PRESETS; tests/test_quant_qat.py keeps the two equal).
QUANT_SCHEMES = tuple(
    ["int8"] + [f"{kind}-g{g}{sym}" for g in (32, 64, 128, 256)
                for kind, sym in (("int4", ""), ("int4", "-asym"), ("8da4w", ""))])
QUANT_SCHEMES = QUANT_SCHEMES + tuple(f"{name}-fp32" for name in QUANT_SCHEMES)


@dataclass
class QuantConfig:
    """The [quant] section: low-precision training, one scheme at a time: float8 matmuls or quantization-aware training."""

    float8: bool = False
    """float8 matmuls for the transformer blocks' linear layers (torchao, dynamic tensorwise scaling); needs
    compute.precision bf16, tp 1 and, on GPUs, compute capability 8.9+ (Hopper, Ada). See fourfold/quant/float8.py."""
    qat: Optional[str] = setting(None, choices=QUANT_SCHEMES)
    """Quantization-aware training: fake-quantize the block linears with this scheme (int8, int4-g32..256[-asym],
    8da4w-g32..256, each with -fp32 scales); none trains in full precision. See docs/quantization.md."""
    embeddings: bool = False
    """With quant.qat (and `fourfold quantize`), also quantize the token embedding table."""
    output: bool = False
    """With quant.qat (and `fourfold quantize`), also quantize the output head."""


@dataclass
class DataConfig:
    """The [data] section: text source or chat JSONL, tokenizer, chat template, cache and validation split."""

    path: Optional[str] = None
    """Text or chat .jsonl data: a file, directory or glob; unset trains on the Python standard library's own source."""
    format: str = setting("auto", choices=DATA_FORMATS)
    """text (a corpus packed into seq_len windows), jsonl (one {"messages": [...]} conversation or {"text": ...}
    record per line, one record per padded sequence, loss on assistant tokens only; see
    fourfold/train/chat_data.py), or auto: jsonl when every file data.path names ends in .jsonl, else text."""
    tokenizer: str = "byte"
    """'byte' (no files needed) or the path of a Hugging Face tokenizer.json."""
    chat_template: str = "auto"
    """jsonl data: the chat template conversations are rendered with. auto: the tokenizer_config.json beside
    data.tokenizer's tokenizer.json (an imported model's own template), else the ChatML default; default:
    the ChatML default; or a path: a model directory with tokenizer_config.json, such a .json file, or a
    plain Jinja file."""
    cache_dir: str = ".cache/fourfold"
    """Where tokenized corpora are memory-mapped, keyed by content and tokenizer."""
    val_fraction: float = setting(0.02, ge=0, lt=1)
    """Fraction of sequences held out for validation."""
    max_bytes: int = setting(16_000_000, ge=0)
    """Read at most this many bytes of text from the source (0: no limit); jsonl data is always read whole."""


@dataclass
class CheckpointConfig:
    """The [checkpoint] section: when and how checkpoints are saved, how many are kept, and initial weights."""

    every: int = setting(100, ge=0)
    """Steps between checkpoints; 0 saves only at the end."""
    keep: int = setting(2, ge=0)
    """Keep the newest K checkpoints; 0 keeps them all."""
    save_final: bool = True
    """Save a checkpoint after the last step."""
    async_save: bool = False
    """Save in the background: training stalls only while this rank's state is copied to host memory."""
    verify: bool = True
    """Check every file's sha256 against the checkpoint's COMPLETE marker before loading (sizes are always checked)."""
    init_from: str = ""
    """Start from the model weights (not optimizer, step or data position) of this fourfold checkpoint or run
    directory, under any layout; the [model] shape comes from its config (explicit [model] keys must agree)."""


@dataclass
class LogConfig:
    """The [log] section: metric records, TensorBoard, progress bar and profiling."""

    every: int = setting(10, ge=1)
    """Steps between metric records."""
    tensorboard: bool = False
    """Also write TensorBoard events (needs the tb extra)."""
    progress: bool = True
    """Show the rich progress bar (rank 0)."""
    profile: bool = False
    """Record a torch.profiler trace of a few steps into the run directory."""


@dataclass
class FaultConfig:
    """The [fault] section: process-group timeout, checkpoint on SIGTERM, and fault injection for tests and demos.

    Injected faults fire only on a job's first attempt (torchrun's TORCHELASTIC_RESTART_COUNT 0), so a job
    launched with --max-restarts recovers from them; see fourfold/train/faults.py.
    """

    timeout_s: float = setting(1800.0, gt=0)
    """Seconds a collective (or the start-up rendezvous) may wait for another rank before the job fails; it
    must cover the slowest step and start-up phase (tokenizing, loading a checkpoint, compiling)."""
    checkpoint_on_sigterm: bool = True
    """On SIGTERM (a preemption, torchrun shutting down), finish the current step, save a checkpoint, exit 143."""
    kill_at_step: int = setting(0, ge=0)
    """Fault injection: kill rank `kill_rank` with SIGKILL as step N starts (0: never)."""
    kill_rank: int = setting(0, ge=0)
    """Fault injection: the rank `kill_at_step` kills."""
    nan_at_step: int = setting(0, ge=0)
    """Fault injection: make rank `nan_rank`'s loss NaN at step N (0: never), to exercise step skipping."""
    nan_steps: int = setting(1, ge=1)
    """Fault injection: how many steps in a row, from `nan_at_step`, get a NaN loss."""
    nan_rank: int = setting(0, ge=0)
    """Fault injection: the rank whose loss `nan_at_step` poisons."""


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
    fault: FaultConfig = field(default_factory=FaultConfig)

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
            value = float(value) if typ is float else ast.literal_eval(value)  # float() reads nan and inf too
        except (ValueError, SyntaxError):
            raise ConfigError(f"{key} takes a value of type {getattr(typ, '__name__', typ)}, not '{value}'; "
                              "`fourfold config` lists each key's valid values.") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is list and isinstance(value, tuple):
        value = list(value)
    if typ in (int, float, str, bool, dict, list):
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ConfigError(f"{key} takes a value of type {typ.__name__}, not {value!r} ({type(value).__name__}); "
                              "`fourfold config` lists each key's valid values.")
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
        if p.is_dir():
            raise ConfigError(f"--config '{p}' is a directory; give a TOML file, e.g. configs/tiny.toml.")
        if not p.is_file():
            raise ConfigError(f"Config file '{p}' does not exist. Presets live in configs/, e.g. configs/tiny.toml.")
        try:
            sections = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"Config file '{p}' is not valid TOML: {e}. Fix that line ([section] tables of "
                              "key = value lines), or start from configs/tiny.toml.") from None
        except (UnicodeDecodeError, OSError) as e:
            raise ConfigError(f"Config file '{p}' could not be read as UTF-8 text ({e}); --config takes a TOML "
                              "file, e.g. configs/tiny.toml.") from None
    return build_config(sections, parse_overrides(args or []))


def field_range(section: str, name: str) -> Range | None:
    """The declared Range of config key section.name, or None when it has none."""
    for f in fields(SECTIONS[section]):
        if f.name == name:
            return f.metadata.get("range")
    raise KeyError(f"{section}.{name}")


def check_value(key: str, value: Any) -> None:
    """Raise ConfigError, naming `key` and its range, unless `value` is one `key` (section.name) accepts.

    The one place a setting's range is enforced: `validate` calls it for every field, and a lower level
    that receives a setting directly (e.g. context parallel's method) calls it instead of re-wording it.
    """
    section, name = key.split(".")
    rng = field_range(section, name) or Range()  # no declared range: any finite value
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float, str)) or rng.accepts(value):
        return
    if rng.choices is not None:
        hint = closest(value, [str(c) for c in rng.choices]) if isinstance(value, str) else ""
        shown = f"'{value}'" if isinstance(value, str) else repr(value)
        raise ConfigError(f"{key} {shown} is not one of {', '.join(map(str, rng.choices))}.{hint} "
                          f"Set --{key} to {rng.text()}.")
    what = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
    of = "of " if rng.text().startswith("at ") else ""
    doc = re.split(r"(?<=[.;])\s", " ".join(field_docs(inspect.getsource(SECTIONS[section])).get(name, "").split()))[0]
    raise ConfigError(f"{key} must be {what}{rng.text()}, got {value}. Set --{key} (or {name} in the [{section}] "
                      f"table) to a value {of}{rng.text()}." + (f" [{section}] {name}: {doc.rstrip('.;')}." if doc else ""))


def validate(cfg: Config) -> None:
    """Check every field's range and the combinations that need no world size (layout rules: fourfold.layout)."""
    for section in SECTIONS:
        for f in fields(SECTIONS[section]):
            check_value(f"{section}.{f.name}", getattr(getattr(cfg, section), f.name))
    m, t, c = cfg.model, cfg.train, cfg.compute
    if m.dim % m.n_heads and not m.head_size:
        raise ConfigError(f"model.dim ({m.dim}) must be divisible by model.n_heads ({m.n_heads}); change model.dim "
                          "or model.n_heads.")
    if m.head_dim % 2:
        raise ConfigError(f"The head size (model.head_size, or model.dim / model.n_heads) = {m.head_dim} must be even "
                          "for rotary embeddings; change model.head_size, model.dim or model.n_heads.")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads ({m.n_kv_heads}) must divide model.n_heads ({m.n_heads}); pick a "
                          "divisor of n_heads (n_heads itself for plain multi-head attention).")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len ({t.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}); "
                          "lower train.seq_len or raise model.max_seq_len.")
    if cfg.quant.float8 and c.precision != "bf16":
        raise ConfigError(f"quant.float8 runs the block matmuls in float8 around a bf16 model; it needs "
                          f"--compute.precision bf16 (got {c.precision}), or set --quant.float8 false.")
    if cfg.quant.qat is not None and cfg.quant.float8:
        raise ConfigError(f"quant.qat {cfg.quant.qat} and quant.float8 are two training schemes of [quant]; pick "
                          "one: set --quant.float8 false or --quant.qat none.")
    rc = c.recompute
    if not (rc in ("none", "full", "selective") or (rc.startswith("every-") and rc[6:].isdigit() and int(rc[6:]) > 0)):
        raise ConfigError(f"compute.recompute '{rc}' is not one of none, full, selective, every-N (N >= 1); "
                          "set --compute.recompute to one of them, e.g. every-2.")
    if m.rope_scaling is not None:
        _check_rope_scaling(m.rope_scaling)
    stages = cfg.parallel.pp_layers
    if stages is not None and not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in stages):
        raise ConfigError(f"parallel.pp_layers {stages} must be a list of whole numbers of at least 1 (blocks per "
                          "pipeline stage), e.g. --parallel.pp_layers '[2, 2]', or none to split evenly.")


ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_seq_len")


def _check_rope_scaling(scaling: dict) -> None:
    missing = set(ROPE_SCALING_KEYS) - set(scaling)
    if missing:
        raise ConfigError(f"model.rope_scaling lacks {', '.join(sorted(missing))}; give all of "
                          f"{', '.join(ROPE_SCALING_KEYS)}, or set it to none.")
    for k in ROPE_SCALING_KEYS:
        v = scaling[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"model.rope_scaling.{k} must be a finite number greater than 0, got {v!r}.")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ConfigError(f"model.rope_scaling.high_freq_factor ({scaling['high_freq_factor']}) must be greater "
                          f"than low_freq_factor ({scaling['low_freq_factor']}): the scaling blends between them.")
