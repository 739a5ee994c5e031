"""Real low-bit linears: int4 nibble packing, the weight layouts torch's own int4/int8 kernels take, and modules that run them.

    Int4WeightLinear.from_float(linear, scheme)   # int4 group-wise (and 8da4w): packed nibbles + scales + zero points
    Int8WeightLinear.from_float(linear, scheme)   # int8 per channel: int8 weight + scales

Both quantize with fake_quant.quantize_weight, so a converted module computes what FakeQuantLinear
computed during QAT, up to the kernels' float rounding. Layouts (checked on torch 2.13 CPU):

- Stored (state_dict, device independent): `weight_int4` uint8 [N, K/2], two nibbles per byte holding
  q + 8 (0..15), element 2j in the high nibble and 2j+1 in the low one, which is the input layout of the
  CUDA converter; `scales` [N, K/G] in the scale dtype; `zero_points` int8 [N, K/G].
- CPU kernel: `_convert_weight_to_int4pack_for_cpu(int32 [N, K] in 0..15, inner_k_tiles)` (it rejects
  uint8), then `_weight_int4pack_mm_for_cpu(x [M, K], packed, G, scales_and_zeros [K/G, N, 2])`, which
  computes x @ ((u - 8) * scale + zero).T with a *float* zero. Our (q - z) * s = (u - 8) * s + (-z * s),
  so zero = -z * s. x and scales_and_zeros must share a dtype (bf16, fp16 or fp32); N must be a multiple
  of 16 and G one of 32/64/128/256.
- CUDA kernel: `_convert_weight_to_int4pack(uint8 [N, K/2] as stored above, inner_k_tiles 8/4/2)` then
  `_weight_int4pack_mm(x bf16, packed, G, scales_and_zeros bf16)`, same formula (sm80+). The nibble
  order (element 2j high) is the one torchao 0.18 feeds this op on CUDA (tile-packed int4 tensors;
  only its XPU path swaps them). Not run by the CPU tests: bench/int4_cuda_check.py checks it on a GPU.
- int8: `_weight_int8pack_mm(x [M, K], w int8 [N, K], scales [N])` = x @ (w * scales).T, scales in
  x's dtype, CPU and CUDA; hence int8 schemes are symmetric.

On CUDA, steps of more than int4_gemm.TINYGEMM_ROWS (6) token rows run fourfold.quant.int4_gemm on the
stored nibbles (a Triton W4A16 GEMM; above 128 rows a Triton dequantize + cuBLAS): torch's tiled kernel wins
at a few rows but is 8-12x slower at 256 rows on an H200. Steps of at most int4_gemv.MAX_ROWS token rows
run fourfold.quant.int4_gemv's Triton GEMV instead, over a copy of the nibbles repacked once into its
group-plane layout (`planes()`, cached like torch's tiled copy). Where fourfold.quant.int4_mma runs (sm80+,
cuda-bindings, bf16), steps of 1-32 token rows take its tensor-core GEMV (`mma_words()`; int4_stream for wide
weights at one row) before either.
The 8da4w module fake-quantizes its input per token (int8, dynamic) before the int4-weight kernel: torch
has no int8-activation x int4-weight kernel, so this reproduces the numbers, not the int8 speed-up.
Plain torch rather than torchao: its int4 weight-only kernels need a package (mslk) that does not install.
"""

from __future__ import annotations

import torch
from torch import nn

from fourfold.errors import ConfigError
from fourfold.quant import int4_gemm
from fourfold.quant import int4_gemv as gemv
from fourfold.quant import int4_mma, int4_stream
from fourfold.quant.fake_quant import fake_quantize_activation, quantize_weight
from fourfold.quant.schemes import QuantScheme, check_group_divides

INNER_K_TILES = 2


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] from values 0..15 shaped [N, K] (K even): element 2j high nibble, 2j+1 low nibble."""
    if u.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last dimension, got {tuple(u.shape)}")
    u = u.to(torch.uint8)
    return (u[..., 0::2] << 4) | (u[..., 1::2] & 0xF)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: uint8 [N, K] of values 0..15."""
    return torch.stack([p >> 4, p & 0xF], dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def scales_and_zeros(scales: torch.Tensor, zero_points: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The int4 kernels' [K/G, N, 2] tensor of (scale, float zero = -zero_point * scale) in `dtype`."""
    s = scales.float()
    return torch.stack([s, -zero_points.float() * s], dim=-1).transpose(0, 1).contiguous().to(dtype)


def cuda_inner_k_tiles(in_features: int) -> int:
    """The CUDA tile-packing parameter: the largest of 8, 4, 2 with in_features a multiple of 16 * it (8 is fastest)."""
    return next(t for t in (8, 4, 2) if in_features % (16 * t) == 0)


def int4_kernel_weight(weight_int4: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The stored nibbles converted to the tiled layout the int4 mm kernel of `device` takes."""
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(weight_int4).to(torch.int32),
                                                                 INNER_K_TILES)
    if device.type == "cuda":   # untested here: no GPU where the tests run; bench/int4_cuda_check.py checks it
        return torch.ops.aten._convert_weight_to_int4pack(weight_int4.to(device).contiguous(),
                                                          cuda_inner_k_tiles(weight_int4.shape[1] * 2))
    raise ConfigError(f"int4 weights run on CPU or CUDA, not {device.type}.")


def _check_linear(linear: nn.Linear, scheme: QuantScheme, bits: int, name: str) -> None:
    if scheme.weight_bits != bits:
        raise ConfigError(f"Layer {name!r}: scheme {scheme.name!r} has {scheme.weight_bits}-bit weights, "
                          f"this module stores {bits}-bit ones.")
    check_group_divides(scheme, name, linear.in_features)
    if bits == 4 and linear.out_features % 16:
        raise ConfigError(f"Layer {name!r} has {linear.out_features} output features; torch's int4 kernel needs "
                          f"a multiple of 16: leave this layer unquantized or use int8.")


class Int4WeightLinear(nn.Module):
    """y = x @ dequant(W).T + b with W stored as packed int4 nibbles, run by torch's int4 kernels (CPU, CUDA)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: QuantScheme) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        groups = in_features // scheme.group_size
        self.register_buffer("weight_int4", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=scheme.torch_scale_dtype))
        self.register_buffer("zero_points", torch.zeros(out_features, groups, dtype=torch.int8))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)
        self._kernel_cache: dict = {}
        self._planes_cache: dict = {}
        self._mma_cache: dict = {}
        self._workspace_cache: dict = {}
        self.register_state_dict_post_hook(_state_dict_stored_nibbles)
        self.register_load_state_dict_pre_hook(_load_stored_nibbles)

    @classmethod
    def from_float(cls, linear: nn.Linear, scheme: QuantScheme, name: str = "linear") -> "Int4WeightLinear":
        _check_linear(linear, scheme, 4, name)
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, scheme)
        q, scales, zeros = quantize_weight(linear.weight, scheme)
        out.weight_int4.copy_(pack_int4((q.to(torch.int16) + 8).cpu()))
        out.scales.copy_(scales)
        out.zero_points.copy_(zeros)
        if linear.bias is not None:
            out.bias = linear.bias.detach().clone()
        return out.to(linear.weight.device)

    @property
    def holds_words(self) -> bool:
        """Whether `weight_int4` holds fourfold.quant.int4_mma's fragment-order words (int32 [N/16, K/64 * 128],
        after `to_words`) instead of the stored nibbles (uint8 [N, K/2]). state_dict writes the stored nibbles
        and load_state_dict takes them either way."""
        return self.weight_int4.dtype == torch.int32

    def words_fit(self, device: torch.device) -> bool:
        """Whether on `device` every token-row count has a kernel that reads the words: the tensor-core GEMVs at
        1-32 rows (int4_mma, int4_stream: CUDA sm80+, cuda-bindings, bf16 scales and bias, K a multiple of 64, N of
        16, N within their limits) and int4_gemm above (Triton, groups of 64 or more)."""
        n, k = self.out_features, self.in_features
        probe = torch.empty(1, k, device=device, dtype=torch.bfloat16) if device.type == "cuda" else None
        return (probe is not None and int4_gemm.available() and self.scheme.group_size % 64 == 0
                and int4_mma.layout_supports(probe, self.scales, k, n)
                and (self.bias is None or self.bias.dtype == torch.bfloat16)
                and n <= int4_mma.MAX_OUT_FEATURES_ROWS
                and (n <= int4_mma.MAX_OUT_FEATURES or int4_stream.use_stream(n, k, 1)))

    def to_words(self) -> None:
        """Keep the weight only as int4_mma's words (the decode GEMVs' layout; int4_gemm reads it too): one run-time
        copy instead of the stored nibbles beside the words (and the Triton GEMV's planes). Any device; the words'
        kernels need words_fit."""
        if not self.holds_words:
            self._replace_weight(int4_mma.repack_mma(self.weight_int4))

    def to_stored(self) -> None:
        """Back to the stored nibbles (undoes to_words)."""
        if self.holds_words:
            self._replace_weight(self.stored_nibbles())

    def _replace_weight(self, weight: torch.Tensor) -> None:
        """`weight_int4` in another layout: the copies cached from the old one are dropped."""
        self.weight_int4 = weight
        self._kernel_cache, self._planes_cache, self._mma_cache = {}, {}, {}

    def stored_nibbles(self) -> torch.Tensor:
        """The stored uint8 [N, K/2] nibbles: `weight_int4`, or made from the words (a new tensor) when it holds them."""
        if not self.holds_words:
            return self.weight_int4
        return pack_int4(int4_mma.unpack_mma(self.weight_int4, self.out_features, self.in_features))

    def _kernel_args(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (x.device, x.dtype, self.weight_int4.data_ptr(), self.scales.data_ptr())
        if key not in self._kernel_cache:
            self._kernel_cache = {key: (int4_kernel_weight(self.stored_nibbles(), x.device),
                                        scales_and_zeros(self.scales, self.zero_points, x.dtype).to(x.device))}
        return self._kernel_cache[key]

    def planes(self) -> torch.Tensor:
        """The nibbles repacked for fourfold.quant.int4_gemv (int32 group planes), made once per weight buffer."""
        key = (self.weight_int4.device, self.weight_int4.data_ptr())
        if key not in self._planes_cache:
            self._planes_cache = {key: gemv.repack_planes(self.stored_nibbles(), self.scheme.group_size)}
        return self._planes_cache[key]

    def mma_words(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The nibbles and scales repacked for fourfold.quant.int4_mma, made once per weight buffer."""
        key = (self.weight_int4.device, self.weight_int4.data_ptr(), self.scales.data_ptr())
        if key not in self._mma_cache:
            words = self.weight_int4 if self.holds_words else int4_mma.repack_mma(self.weight_int4)
            self._mma_cache = {key: (words, int4_mma.scale_words(self.scales, self.zero_points))}
        return self._mma_cache[key]

    def mma_workspace(self, split: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The partial sums and tickets of an int4_mma launch that splits K over `split` blocks, made once per
        weight device and split (like the repacked words: at the first decode step, before graph capture)."""
        key = (self.weight_int4.device, split)
        if key not in self._workspace_cache:
            self._workspace_cache[key] = int4_mma.split_workspace(self.out_features // 16, split, key[0])
        return self._workspace_cache[key]

    def _uses_mma(self, x: torch.Tensor) -> bool:
        return (int4_mma.supports(x, self.scales, self.in_features, self.out_features)
                and (self.bias is None or self.bias.dtype == torch.bfloat16))

    def _uses_stream(self, x: torch.Tensor) -> bool:
        rows = x.numel() // self.in_features
        return (int4_stream.use_stream(self.out_features, self.in_features, rows)
                and int4_mma.layout_supports(x, self.scales, self.in_features, self.out_features)
                and (self.bias is None or self.bias.dtype == torch.bfloat16))

    def uses_gemv(self, x: torch.Tensor) -> bool:
        """Whether x (.., K) runs a decode GEMV with its fusions: the tensor-core one (fourfold.quant.int4_mma, up
        to 32 rows where it runs) or the Triton one (CUDA, at most int4_gemv.MAX_ROWS rows), not torch's mm."""
        rows = x.numel() // self.in_features if self.in_features else 0
        return self._uses_mma(x) or self._uses_stream(x) or (gemv.available() and x.is_cuda and 0 < rows <= gemv.MAX_ROWS
                                                             and not self.holds_words)

    def decode(self, x: torch.Tensor, *, gated: bool = False, residual: torch.Tensor | None = None,
               norm_weight: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
        """The int4 GEMV (see uses_gemv) with its fusions: `gated` SiLU*mul, `residual` add, `norm_weight`: x is
        RMS-normalised first (fourfold.quant.int4_gemv). x is used as given (no activation fake-quant)."""
        rows = x.numel() // self.in_features
        if self._uses_stream(x) and (norm_weight is None or norm_weight.dtype == torch.bfloat16):
            words, scale_words = self.mma_words()
            return int4_stream.int4_stream_gemv(x, words, scale_words, self.scheme.group_size, self.bias, gated=gated,
                                                residual=residual, norm_weight=norm_weight, eps=eps)
        # one row of the gated form: the Triton GEMV is faster (H200 llama-1b: 6.0 vs 6.4 us; the other shapes
        # 2.5-4.3 us with the mma kernel against 2.5-4.5; bench/int4_mma_check.py)
        staged = int4_mma.use_staged(self.out_features, self.in_features, rows)
        triton_row = gated and rows <= gemv.MAX_ROWS and gemv.available() and not staged and not self.holds_words
        if self._uses_mma(x) and not triton_row and (norm_weight is None or norm_weight.dtype == torch.bfloat16):
            words, scale_words = self.mma_words()
            launch = (int4_mma.staged_config(self.in_features, self.scheme.group_size, gated, rows=rows) if staged
                      else int4_mma.config(self.in_features, self.scheme.group_size, gated, rows=rows))
            workspace = self.mma_workspace(launch[2]) if launch[2] > 1 else None
            return int4_mma.int4_mma_gemv(x, words, scale_words, self.scheme.group_size, self.bias, gated=gated,
                                          residual=residual, norm_weight=norm_weight, eps=eps, launch_config=launch,
                                          workspace=workspace, staged=staged)
        if self.holds_words:
            raise ValueError("an int4 linear holding int4_mma's words (to_words) runs decode steps on the tensor-core "
                             "GEMVs only: bf16 activations, norm weight and bias (see words_fit)")
        return gemv.int4_gemv(x, self.weight_int4, self.scales, self.zero_points, self.scheme.group_size, self.bias,
                              gated=gated, asym=not self.scheme.symmetric, words=self.planes(), residual=residual,
                              norm_weight=norm_weight, eps=eps)

    def uses_gemm(self, x: torch.Tensor) -> bool:
        """Whether x (.., K) runs fourfold.quant.int4_gemm (CUDA, more than int4_gemm.TINYGEMM_ROWS rows)."""
        rows = x.numel() // self.in_features if self.in_features else 0
        return int4_gemm.available() and x.is_cuda and (rows > int4_gemm.TINYGEMM_ROWS or self.holds_words)

    def forward(self, x: torch.Tensor, gated: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ dequant(W).T + b; `gated` and `residual` (GEMV path only: see uses_gemv) return silu(first half) *
        second half, and residual + the result (rounded as an eager residual add)."""
        if self.scheme.activation != "none":
            x = fake_quantize_activation(x)
        if self.uses_gemv(x):
            return self.decode(x, gated=gated, residual=residual)
        if gated or residual is not None:
            raise ValueError("gated int4 linears and fused residual adds run only on the GEMV path (see uses_gemv)")
        out_dtype = x.dtype
        if x.device.type == "cuda" and x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)    # the CUDA kernels take bf16 activations
        if self.uses_gemm(x):
            return int4_gemm.int4_gemm(x, self.weight_int4, self.scales, self.zero_points, self.scheme.group_size,
                                       self.bias, asym=not self.scheme.symmetric, words=self.holds_words).to(out_dtype)
        packed, sz = self._kernel_args(x)
        x2 = x.reshape(-1, self.in_features).contiguous()
        if x.device.type == "cpu":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, self.scheme.group_size, sz)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x2, packed, self.scheme.group_size, sz)
        y = y.reshape(*x.shape[:-1], self.out_features).to(out_dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"


def _state_dict_stored_nibbles(module: Int4WeightLinear, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict post hook: checkpoints always hold the stored nibbles, whichever layout the module runs."""
    key = prefix + "weight_int4"
    if module.holds_words and key in state_dict:
        state_dict[key] = module.stored_nibbles()


def _load_stored_nibbles(module: Int4WeightLinear, state_dict: dict, prefix: str, *args) -> None:
    """load_state_dict pre hook: stored nibbles loaded into a module that holds words are repacked first."""
    key = prefix + "weight_int4"
    if module.holds_words and key in state_dict and state_dict[key].dtype == torch.uint8:
        state_dict[key] = int4_mma.repack_mma(state_dict[key])


class Int8WeightLinear(nn.Module):
    """y = x @ (W * scales).T + b with W stored int8 per output channel, run by `_weight_int8pack_mm`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: QuantScheme) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, dtype=scheme.torch_scale_dtype))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    def from_float(cls, linear: nn.Linear, scheme: QuantScheme, name: str = "linear") -> "Int8WeightLinear":
        _check_linear(linear, scheme, 8, name)
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, scheme)
        q, scales, _ = quantize_weight(linear.weight, scheme)   # symmetric: zero points are 0
        out.weight_int8.copy_(q)
        out.scales.copy_(scales[:, 0])
        if linear.bias is not None:
            out.bias = linear.bias.detach().clone()
        return out.to(linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(x2, self.weight_int8, self.scales.to(x.dtype))
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme.name}"
