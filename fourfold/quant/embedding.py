"""Quantized token embeddings: a fake-quant nn.Embedding for QAT and a packed one (int4 or int8 rows) for inference.

    FakeQuantEmbedding.from_embedding(emb, scheme)   # rows fake-quantized group-wise along the hidden dim
    QuantEmbedding.from_float(emb, scheme)           # stores the same ints packed; looks rows up, dequantizes them

An embedding table [vocab, dim] is quantized like a linear weight [out, in] with groups along `dim`
(int8: one scale per row). Only the weight part of a scheme applies: an embedding's input is token ids,
so 8da4w quantizes an embedding exactly like int4 of the same group size. Lookups dequantize only the
rows asked for, so the full-precision table never exists at inference.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from fourfold.quant.fake_quant import dequantize_weight, fake_quantize_weight_sharded, quantize_weight
from fourfold.quant.packing import pack_int4, unpack_int4
from fourfold.quant.schemes import QuantScheme, check_group_divides


def weight_only(scheme: QuantScheme) -> QuantScheme:
    """The scheme without its activation part (what an embedding table uses)."""
    return dataclasses.replace(scheme, activation="none")


class FakeQuantEmbedding(nn.Embedding):
    """nn.Embedding whose table is fake-quantized in every forward (straight-through); parameter 'weight'."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, scheme: QuantScheme, device=None, dtype=None,
                 name: str = "tok_embeddings") -> None:
        check_group_divides(scheme, name, embedding_dim)
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self.scheme, self.layer_name = weight_only(scheme), name

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, scheme: QuantScheme, name: str = "tok_embeddings"):
        """A FakeQuantEmbedding sharing `emb`'s weight tensor (no copy)."""
        out = cls(emb.num_embeddings, emb.embedding_dim, scheme=scheme, device="meta", name=name)
        out.weight = emb.weight
        return out

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, fake_quantize_weight_sharded(self.weight, self.scheme, self.layer_name))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", scheme={self.scheme.name}"


class QuantEmbedding(nn.Module):
    """Embedding table stored as int4 nibbles (or int8) + per-group scales and zero points; rows dequantized on lookup."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scheme: QuantScheme,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.scheme, self.num_embeddings, self.embedding_dim, self.dtype = weight_only(scheme), num_embeddings, \
            embedding_dim, dtype
        groups = 1 if scheme.group_size is None else embedding_dim // scheme.group_size
        width = embedding_dim // 2 if scheme.weight_bits == 4 else embedding_dim
        kind = torch.uint8 if scheme.weight_bits == 4 else torch.int8
        self.register_buffer("weight_q", torch.zeros(num_embeddings, width, dtype=kind))
        self.register_buffer("scales", torch.ones(num_embeddings, groups, dtype=scheme.torch_scale_dtype))
        self.register_buffer("zero_points", torch.zeros(num_embeddings, groups, dtype=torch.int8))

    @classmethod
    def from_float(cls, emb: nn.Embedding, scheme: QuantScheme, name: str = "tok_embeddings") -> "QuantEmbedding":
        check_group_divides(scheme, name, emb.embedding_dim)
        out = cls(emb.num_embeddings, emb.embedding_dim, scheme, emb.weight.dtype)
        q, scales, zeros = quantize_weight(emb.weight, out.scheme)
        out.weight_q.copy_(pack_int4((q.to(torch.int16) + 8)) if scheme.weight_bits == 4 else q)
        out.scales.copy_(scales)
        out.zero_points.copy_(zeros)
        return out.to(emb.weight.device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.weight_q[tokens.reshape(-1)]
        q = unpack_int4(rows).to(torch.int16) - 8 if self.scheme.weight_bits == 4 else rows
        flat = tokens.reshape(-1)
        w = dequantize_weight(q, self.scales[flat], self.zero_points[flat], self.scheme, self.dtype)
        return w.reshape(*tokens.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.scheme.name}"
