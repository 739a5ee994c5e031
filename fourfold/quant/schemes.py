"""Quantization schemes (int8 per-channel, int4 group-wise, 8da4w) as frozen data, their named presets, and shape checks.

    scheme = scheme_by_name("int4-g128")          # ConfigError listing the valid names if unknown
    check_group_divides(scheme, "layers.0.attention.wq", in_features=4096)

A scheme only describes the numbers; fake_quant.py and packing.py do the work. Integer ranges are
signed, [-2^(b-1), 2^(b-1) - 1], for symmetric and asymmetric schemes alike (asymmetric ones add an
integer zero point in the same range), so one dequantization formula, (q - zero_point) * scale, covers
every scheme.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fourfold.errors import ConfigError, closest

GROUP_SIZES = (32, 64, 128, 256)        # the group sizes torch's int4 kernels accept
SCALE_DTYPES = ("bfloat16", "float32")
ACTIVATIONS = ("none", "int8-dynamic-per-token")


@dataclass(frozen=True)
class QuantScheme:
    """How a linear layer's weight (and, for 8da4w, its input activations) is quantized.

    weight_bits: 4 (group-wise, `group_size` in GROUP_SIZES) or 8 (per output channel, group_size None).
    symmetric: zero point fixed at 0 and scale = max|w| / qmax; asymmetric uses the group's [min, max]
        (widened to include 0) and an integer zero point. int8 weights are symmetric only: torch's int8
        weight kernel (`_weight_int8pack_mm`) takes scales and no zero points.
    scale_dtype: dtype the scales are stored (and rounded) in, "bfloat16" or "float32".
    activation: "none" (weight-only) or "int8-dynamic-per-token" (8da4w: each input row quantized to int8,
        asymmetric, with a scale computed from that row at run time).
    """

    weight_bits: int = 4
    group_size: int | None = 128
    symmetric: bool = True
    scale_dtype: str = "bfloat16"
    activation: str = "none"

    def __post_init__(self) -> None:
        if self.weight_bits == 4:
            if self.group_size not in GROUP_SIZES:
                raise ConfigError(f"int4 weights need a group size in {list(GROUP_SIZES)}, got {self.group_size}.")
        elif self.weight_bits == 8:
            if self.group_size is not None:
                raise ConfigError(f"int8 weights are quantized per output channel: set group_size to None, "
                                  f"not {self.group_size}.")
            if not self.symmetric:
                raise ConfigError("int8 weights must be symmetric: torch's int8 weight kernel takes scales, "
                                  "no zero points.")
        else:
            raise ConfigError(f"weight_bits must be 4 or 8, got {self.weight_bits}.")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ConfigError(f"scale_dtype must be one of {list(SCALE_DTYPES)}, got {self.scale_dtype!r}."
                              + closest(str(self.scale_dtype), SCALE_DTYPES))
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation must be one of {list(ACTIVATIONS)}, got {self.activation!r}."
                              + closest(str(self.activation), ACTIVATIONS))
        if self.activation != "none" and self.weight_bits != 4:
            raise ConfigError("int8 dynamic activations go with int4 weights (8da4w) only.")

    @property
    def qmin(self) -> int:
        return -(1 << (self.weight_bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.weight_bits - 1)) - 1

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return getattr(torch, self.scale_dtype)

    @property
    def name(self) -> str:
        """The preset name of this scheme ('int4-g128-asym', '8da4w-g32', ...), plus '-fp32' for float32 scales."""
        if self.weight_bits == 8:
            base = "int8"
        else:
            base = ("8da4w" if self.activation != "none" else "int4") + f"-g{self.group_size}"
            base += "" if self.symmetric else "-asym"
        return base + ("-fp32" if self.scale_dtype == "float32" else "")


def _presets() -> dict[str, QuantScheme]:
    schemes = [QuantScheme(weight_bits=8, group_size=None)]
    for g in GROUP_SIZES:
        for symmetric in (True, False):
            schemes.append(QuantScheme(weight_bits=4, group_size=g, symmetric=symmetric))
        schemes.append(QuantScheme(weight_bits=4, group_size=g, activation="int8-dynamic-per-token"))
    schemes += [dataclasses.replace(s, scale_dtype="float32") for s in schemes]
    return {s.name: s for s in schemes}


PRESETS: dict[str, QuantScheme] = _presets()


def scheme_by_name(name: str) -> QuantScheme:
    """The preset called `name`; ConfigError with the valid names (and the closest one) when there is none."""
    if name in PRESETS:
        return PRESETS[name]
    raise ConfigError(f"Unknown quantization scheme {name!r}." + closest(name, PRESETS)
                      + f" Valid schemes: {', '.join(PRESETS)}.")


def check_group_divides(scheme: QuantScheme, layer: str, in_features: int) -> None:
    """Raise ConfigError, naming the layer and what to change, when the group size does not divide its input dim."""
    if scheme.group_size is None or in_features % scheme.group_size == 0:
        return
    fits = [g for g in GROUP_SIZES if in_features % g == 0]
    fix = (f"use a scheme with group size {' or '.join(map(str, fits))}" if fits
           else "leave this layer unquantized or use int8 (per-channel)")
    raise ConfigError(f"Layer {layer!r} has {in_features} input features, which group size {scheme.group_size} "
                      f"of scheme {scheme.name!r} does not divide: {fix}.")
