"""Quantization-aware training and conversion: swap a Llama's linears for fake-quant ones, then for packed low-bit ones.

    prepare_qat(model, scheme)              # QAT: block linears -> FakeQuantLinear (same parameters, same names)
    convert(model)                          # after QAT: FakeQuant* -> Int4WeightLinear / Int8WeightLinear / QuantEmbedding
    ptq(model, scheme)                      # post-training, round-to-nearest: prepare_qat + convert, no training
    ptq(model, scheme, method="gptq", calibration=[tokens, ...])   # post-training, GPTQ (gptq.py), same format
    meta = quant_meta(model)                # {"scheme": "int4-g128", "embeddings": False, "output": False, ...}
    quantized_skeleton(model, meta)         # a fresh model's linears -> empty packed modules, for load_state_dict

Which layers: every linear of every transformer block (q, k, v, o, w1, w2, w3). The output head and the
token embedding only when asked (`output=True`, `embeddings=True`; config quant.output / quant.embeddings),
off by default: the head's vocab-sized matmul feeds the loss directly and suffers most from rounding,
and the embedding is a lookup whose size, not speed, quantization would change.

Scales are computed on the fly from the current weights in every forward (see fake_quant.py); nothing
is learned, so a QAT checkpoint is an ordinary checkpoint (same names, float weights) whose config says
quant.qat, and `convert` recomputes exactly the scales the last training forward used. The estimator
is straight-through with clipping (fake_quant.py).

Every check runs before any module is swapped: `check_scheme_fits` raises ConfigError naming the layer
when a group size does not divide its input features (also per tensor-parallel shard), or, for
conversion, when int4's kernel cannot take its output features.
"""

from __future__ import annotations

import torch
from torch import nn

from fourfold.errors import ConfigError
from fourfold.models.llama import Llama
from fourfold.quant.embedding import FakeQuantEmbedding, QuantEmbedding
from fourfold.quant.fake_quant import FakeQuantLinear
from fourfold.quant.gptq import gptq_modules
from fourfold.quant.packing import Int4WeightLinear, Int8WeightLinear
from fourfold.quant.schemes import QuantScheme, check_group_divides, scheme_by_name

PTQ_METHODS = ("rtn", "gptq")   # what ptq() takes: round to nearest; GPTQ with calibration batches


def quant_targets(model: nn.Module, embeddings: bool = False, output: bool = False) -> list[tuple[str, nn.Module]]:
    """(name, module) of every layer a scheme applies to: the blocks' linears, plus head / embedding if asked."""
    out = []
    for name, module in model.named_modules():
        leaf = name.split(".")[-1]
        if name.startswith("layers.") and isinstance(module, nn.Linear):
            out.append((name, module))
        elif leaf == "output" and output and isinstance(module, nn.Linear):
            out.append((name, module))
        elif leaf == "tok_embeddings" and embeddings and isinstance(module, nn.Embedding):
            out.append((name, module))
    return out


def _in_features(module: nn.Module) -> int:
    return module.embedding_dim if isinstance(module, nn.Embedding) else module.in_features


def _shard_in_features(module: nn.Module) -> int | None:
    """Input features of this rank's tensor-parallel shard when the weight is split along them (row-parallel)."""
    w = module.weight
    placements = getattr(w, "placements", ())
    if any(getattr(p, "dim", None) in (1, -1) for p in placements):
        return w.to_local().shape[1]
    return None


def check_scheme_fits(model: nn.Module, scheme: QuantScheme, *, embeddings: bool = False, output: bool = False,
                      for_kernels: bool = False, tp: int = 1) -> None:
    """ConfigError (naming the layer and what to change) unless `scheme` applies to every target layer of `model`.

    `tp` checks the row-parallel shards a tensor-parallel run would make (groups must not straddle them);
    on a model already sharded, the shard shapes are read from the weights. `for_kernels` also checks what
    conversion needs (int4: output features a multiple of 16).
    """
    targets = quant_targets(model, embeddings, output)
    if not targets:
        raise ConfigError("The model has no layer to quantize (no transformer block here, head and embedding off).")
    for name, module in targets:
        check_group_divides(scheme, name, _in_features(module))
        shard = _shard_in_features(module)
        row_parallel = name.endswith(("attention.wo", "feed_forward.w2"))
        if shard is None and tp > 1 and row_parallel:
            shard = _in_features(module) // tp
        if shard is not None and scheme.group_size is not None and shard % scheme.group_size:
            raise ConfigError(f"Layer {name!r} is split by tensor parallel into shards of {shard} input features, "
                              f"which group size {scheme.group_size} of scheme {scheme.name!r} does not divide: a "
                              f"group would straddle two ranks and its scale would differ from one process's. Use a "
                              f"group size dividing {shard}, or a smaller parallel.tp.")
        if for_kernels and isinstance(module, nn.Linear) and scheme.weight_bits == 4 and module.out_features % 16:
            raise ConfigError(f"Layer {name!r} has {module.out_features} output features; torch's int4 kernel needs "
                              "a multiple of 16: use an int8 scheme, or leave the head unquantized.")


def check_device_runs(scheme: QuantScheme, device: torch.device) -> None:
    """ConfigError unless converted modules of `scheme` can run on `device` (CPU; CUDA with compute capability 8.0+)."""
    device = torch.device(device)
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ConfigError(f"Converted {scheme.name} models run on CPU or CUDA, not {device.type}.")
    major, minor = torch.cuda.get_device_capability(device)
    if scheme.weight_bits == 4 and major < 8:
        raise ConfigError(f"Scheme {scheme.name!r} needs torch's int4 CUDA kernel (compute capability 8.0+, "
                          f"Ampere or newer); this GPU is {major}.{minor}. Use int8, or run on the CPU.")


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)


def prepare_qat(model: nn.Module, scheme: QuantScheme | str, *, embeddings: bool = False, output: bool = False,
                tp: int = 1) -> nn.Module:
    """Swap the target layers of `model` for fake-quant ones in place (parameters shared, names unchanged); return it.

    Works on a meta-device model and on one already tensor-parallel (DTensor weights). Layers already
    fake-quantized are left alone.
    """
    scheme = scheme_by_name(scheme) if isinstance(scheme, str) else scheme
    check_scheme_fits(model, scheme, embeddings=embeddings, output=output, tp=tp)
    for name, module in quant_targets(model, embeddings, output):
        if isinstance(module, (FakeQuantLinear, FakeQuantEmbedding)):
            continue
        if isinstance(module, nn.Embedding):
            _swap(model, name, FakeQuantEmbedding.from_embedding(module, scheme, name))
        else:
            _swap(model, name, FakeQuantLinear.from_linear(module, scheme, name))
    model.quant_settings = {"scheme": scheme.name, "embeddings": embeddings, "output": output}
    return model


def _packed_class(scheme: QuantScheme):
    return Int4WeightLinear if scheme.weight_bits == 4 else Int8WeightLinear


@torch.no_grad()
def convert(model: nn.Module) -> nn.Module:
    """Replace every fake-quant layer of a (single-process, plain-tensor) model by its packed low-bit module."""
    fakes = [(n, m) for n, m in model.named_modules() if isinstance(m, (FakeQuantLinear, FakeQuantEmbedding))]
    if not fakes:
        raise ConfigError("convert() found no fake-quant layer: call prepare_qat(model, scheme) first (or use ptq).")
    for name, module in fakes:   # every check before the first swap
        if isinstance(module, nn.Linear) and module.scheme.weight_bits == 4 and module.out_features % 16:
            raise ConfigError(f"Layer {name!r} has {module.out_features} output features; torch's int4 kernel "
                              "needs a multiple of 16: use an int8 scheme, or leave the head unquantized.")
    for name, module in fakes:
        if isinstance(module, FakeQuantEmbedding):
            _swap(model, name, QuantEmbedding.from_float(module, module.scheme, name))
        else:
            _swap(model, name, _packed_class(module.scheme).from_float(module, module.scheme, name))
    settings = getattr(model, "quant_settings", {"scheme": fakes[0][1].scheme.name})
    model.quant_settings = {**settings, "converted": True}
    return model


def ptq(model: nn.Module, scheme: QuantScheme | str, *, method: str = "rtn", embeddings: bool = False,
        output: bool = False, calibration: list[torch.Tensor] | None = None) -> nn.Module:
    """Post-training quantization, then conversion to packed modules, in place; returns the model.

    method "rtn": round each weight to the nearest point of the scheme's grid. "gptq": round the linears by
    GPTQ (fourfold.quant.gptq) on `calibration`, a list of token batches [batch, seq]; the embedding, when
    asked, is rounded to nearest (a lookup has no input statistics). Both give the same packed format.
    """
    if method not in PTQ_METHODS:
        raise ConfigError(f"Unknown post-training method {method!r}; valid: {', '.join(PTQ_METHODS)}.")
    if method == "gptq" and not calibration:
        raise ConfigError("GPTQ needs calibration data: pass calibration=[token batches] (a few dozen sequences of "
                          "the kind of text the model will see), or use method='rtn'.")
    scheme = scheme_by_name(scheme) if isinstance(scheme, str) else scheme
    check_scheme_fits(model, scheme, embeddings=embeddings, output=output, for_kernels=True)
    if method == "gptq":
        linears = [(n, m) for n, m in quant_targets(model, embeddings, output) if isinstance(m, nn.Linear)]
        for name, packed in gptq_modules(model, linears, scheme, calibration).items():
            _swap(model, name, packed)
        if embeddings:
            _swap(model, "tok_embeddings", QuantEmbedding.from_float(model.tok_embeddings, scheme, "tok_embeddings"))
        model.quant_settings = {"scheme": scheme.name, "embeddings": embeddings, "output": output, "converted": True}
    else:
        prepare_qat(model, scheme, embeddings=embeddings, output=output)
        convert(model)
    model.quant_settings["method"] = method
    return model


def quant_meta(model: nn.Module) -> dict:
    """What a converted checkpoint's meta.json records under "quant": scheme name, embeddings, output, method."""
    settings = getattr(model, "quant_settings", None)
    if not settings or not settings.get("converted"):
        raise ConfigError("quant_meta() needs a converted model (convert() or ptq()).")
    return {"scheme": settings["scheme"], "embeddings": bool(settings.get("embeddings")),
            "output": bool(settings.get("output")), "method": settings.get("method", "qat"),
            "format": "fourfold-packed-v1"}


def quantized_skeleton(model: nn.Module, meta: dict) -> nn.Module:
    """Swap a freshly built float model's target layers for empty packed modules described by a checkpoint's
    meta["quant"], in place, so that loading the checkpoint's tensors fills them; returns the model."""
    try:
        scheme = scheme_by_name(meta["scheme"])
        embeddings, output = bool(meta.get("embeddings", False)), bool(meta.get("output", False))
    except (KeyError, TypeError):
        raise ConfigError(f"meta.json's \"quant\" entry {meta!r} is not a fourfold quantization record "
                          "(it needs at least a \"scheme\").") from None
    check_scheme_fits(model, scheme, embeddings=embeddings, output=output, for_kernels=True)
    dtype = next(model.parameters()).dtype
    for name, module in quant_targets(model, embeddings, output):
        if isinstance(module, nn.Embedding):
            _swap(model, name, QuantEmbedding(module.num_embeddings, module.embedding_dim, scheme, dtype))
        else:
            new = _packed_class(scheme)(module.in_features, module.out_features, module.bias is not None, scheme)
            _swap(model, name, new)
    model.quant_settings = {"scheme": scheme.name, "embeddings": embeddings, "output": output, "converted": True,
                            "method": meta.get("method", "qat")}
    return model


def apply_checkpoint_quant(model: nn.Module, meta: dict) -> nn.Module:
    """Make a freshly built float model match what a checkpoint holds, before loading it: converted checkpoints
    (meta["quant"]) get empty packed modules, QAT checkpoints (config quant.qat) their fake-quant layers."""
    if meta.get("quant"):
        return quantized_skeleton(model, meta["quant"])
    quant = meta.get("config", {}).get("quant", {})
    if quant.get("qat"):
        prepare_qat(model, quant["qat"], embeddings=bool(quant.get("embeddings")), output=bool(quant.get("output")))
    return model


def check_config_fits(model_cfg, quant_cfg, tp: int = 1) -> None:
    """check_scheme_fits for the model a config describes (built on the meta device: no memory, no weights)."""
    with torch.device("meta"):
        model = Llama(model_cfg)
    check_scheme_fits(model, scheme_by_name(quant_cfg.qat), embeddings=quant_cfg.embeddings, output=quant_cfg.output,
                      tp=tp)
