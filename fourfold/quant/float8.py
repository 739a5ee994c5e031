"""float8 training matmuls for the transformer blocks' linear layers, through torchao (quant.float8).

    apply_float8(model)   # before recomputation and compile, like the other steps of fourfold.parallel.apply

Each block linear becomes torchao's `Float8Linear` with dynamic tensorwise scaling: the input and weight
are cast to float8 e4m3 and the output gradient to e5m2 for the three matmuls of forward and backward;
master weights, gradients and optimizer state stay as they were, and parameter names do not change, so
checkpoints move freely between float8 and bf16 runs. The output head stays in bf16 (the logits feed
the loss directly, and its vocab-sized matmul is where float8 rounding hurts most), as do linears whose
dimensions are not multiples of 16 (float8 matmul kernels require it). Float8 pays on Hopper (or Ada)
tensor cores with torch.compile fusing the casts; torchao also runs it on CPU, which the tests use.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from fourfold.errors import ConfigError


def require_torchao() -> None:
    """Raise ConfigError, saying how to install it, when torchao (the float8 training linear) is missing."""
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("quant.float8 needs torchao, which is not installed: pip install 'fourfold[float8]', "
                          "or set --quant.float8 false.")


def converts_to_float8(module: nn.Module, name: str) -> bool:
    """Whether the linear `module` at path `name` runs its matmuls in float8 (see the module docstring)."""
    if not isinstance(module, nn.Linear) or name.split(".")[-1] == "output":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def check_float8_device(model: nn.Module, device: torch.device | None = None) -> None:
    """Raise ConfigError when `model` will run (on `device`, default its parameters' device) on a GPU without
    float8 tensor cores (before compute capability 8.9); a model built on the meta device passes `device`."""
    if device is None:
        param = next(model.parameters(), None)
        device = param.device if param is not None else None
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ConfigError(f"quant.float8 needs float8 tensor cores (compute capability 8.9+: Hopper, Ada); "
                              f"this GPU is {major}.{minor}. Set --quant.float8 false.")


def apply_float8(model: nn.Module, device: torch.device | None = None) -> None:
    """Swap the qualifying linears of `model` (`converts_to_float8`) for torchao Float8Linear in place.

    Works on a model on the meta device; `device` is then where it will run (checked for float8 support).
    """
    require_torchao()
    check_float8_device(model, device)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=converts_to_float8)
