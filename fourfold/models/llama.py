"""The Llama model, written once in plain PyTorch; every parallel layout is applied to it from outside.

Token embedding -> N x [RMSNorm -> grouped-query attention with rotary positions -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> output head. Shapes follow Hugging Face's
`LlamaForCausalLM` (rotate-half rotary, `[out, in]` linear weights), so weights convert by renaming.

Hooks the parallel code relies on:
- `layers` is a ModuleDict keyed "0".."N-1": pipeline stages delete the blocks they do not own and keep
  the parameter names (so checkpoints reshard between layouts by name).
- `tok_embeddings`, `norm` and `output` may be set to None on middle pipeline stages; `forward` then
  takes and returns hidden states.
- Attention heads are inferred from tensor shapes (`view(b, s, -1, head_dim)`), so tensor parallel
  only has to shard the weights.
- The attention core (`Attention.core`) is a module of its own: context parallel swaps it for ring
  attention, selective recomputation wraps it.
- `seq_shards`: sequence parallel sets it to tp, since hidden states then hold seq / tp positions
  and the rotary table must still cover the whole sequence.
- `forward(tokens, positions=None)` (positional, as the trainer and the pipeline executor call it):
  `positions` gives each token's absolute position, one vector for the batch (seq,) (context parallel
  passes its chunk's positions) or one per sequence (batch, seq); by default 0..seq-1.

One forward for training and inference: `forward(tokens, positions, cache=step, logits_for=idx)`.
`cache` is an attention-cache object for this step (fourfold.models.attention documents the seam):
each block's attention then calls `cache.attend(layer_idx, q, k, v)` instead of its core. Without a
cache, training runs exactly the ops it always did (SDPA with is_causal, no mask, no copies).
`logits_for` picks the token rows (indices into the flattened batch * seq) the head is applied to,
e.g. each sequence's last token when generating.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fourfold.config import ModelConfig
from fourfold.models.attention import AttentionCache
from fourfold.models.init import init_parameters


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in at least float32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` normalised over its last dimension and scaled by the weight, in `x`'s dtype."""
        wide = torch.promote_types(x.dtype, torch.float32)  # float32 for bf16/fp16, float64 stays float64
        xw = x.to(wide)
        normed = xw * torch.rsqrt(xw.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.to(wide)).to(x.dtype)


def rotary_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with Llama-3 frequency scaling when `scaling` is set."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_seq_len"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    smooth = ((old_len / wavelen) - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    between = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(between, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def rotary_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (max_seq_len, head_dim), float32, rotate-half layout."""
    inv_freq = rotary_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` (batch, seq, heads, head_dim) by per-token angles; cos/sin are ([batch,] seq, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos = cos.unsqueeze(-2).to(x.dtype)  # broadcast over heads
    sin = sin.unsqueeze(-2).to(x.dtype)
    return x * cos + rotated * sin


class CausalAttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v for q (b, hq, s, d) and k, v (b, hkv, s, d), hq % hkv == 0."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention output (b, hq, s, d)."""
        # enable_gqa lets the kernel read each kv head for its group of query heads instead of copying
        # K and V per query head (10% faster fwd+bwd on an H100 for the 1.1B shape: bench/sdpa_gqa.py).
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=bias)
        self.core = CausalAttentionCore()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AttentionCache | None = None,
                layer_idx: int = 0) -> torch.Tensor:
        """Self-attention of x (batch, seq, dim), rotated by cos/sin ([batch,] seq, head_dim); same shape out.

        Without `cache` the core attends causally within x's sequence; with one, `cache.attend(layer_idx, ...)`
        stores this step's keys and values and attends over everything cached.
        """
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        out = self.core(q, k, v) if cache is None else cache.attend(layer_idx, q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int, bias: bool = False):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=bias)
        self.w3 = nn.Linear(dim, ffn_dim, bias=bias)
        self.w2 = nn.Linear(ffn_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The SwiGLU MLP applied to x (..., dim); returns (..., dim)."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: AttentionCache | None = None,
                layer_idx: int = 0) -> torch.Tensor:
        """x (batch, seq, dim) through the attention and MLP residual branches; same shape.

        `cache` and `layer_idx` go to the attention by keyword: tensor parallel's input plan for the
        attention module lays out its three positional inputs only.
        """
        h = x + self.attention(self.attention_norm(x), cos, sin, cache=cache, layer_idx=layer_idx)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """A Llama-family decoder; `forward(tokens)` returns logits (batch, seq, vocab)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.seq_shards = 1  # sequence parallel sets tp: hidden states then hold seq / tp positions
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Filled by init_weights (computed, never saved); built under torch.device("meta") they hold no data.
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initial values of every parameter and the rotary tables; what is on the meta device is left alone.

        Parameters: normal(0, init_std), residual outputs scaled by 1/sqrt(2 * n_layers), norms 1, drawn
        from generators seeded by (`seed`, the parameter's name, row block), `seed` defaulting to
        torch.initial_seed() (fourfold.models.init); on a sharded model (after `to_empty`) each rank
        fills only its own shard, with the values one process would have there.
        """
        if self.rope_cos.device.type != "meta":
            cos, sin = rotary_tables(self.cfg)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        init_parameters(self, self.cfg, seed)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, *,
                cache: AttentionCache | None = None, logits_for: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq).

        `positions`: each token's absolute position, (seq,) for the whole batch or (batch, seq) per
        sequence; default 0..seq-1 (under sequence parallel the whole sequence's, seq_shards * local).
        `cache`: this step's attention cache (fourfold.models.attention); None trains/evaluates causally.
        `logits_for`: indices into the flattened batch * seq tokens; only those rows get the final norm
        and the head, and the logits are (len(logits_for), vocab).

        On a pipeline stage without the embedding or the head it takes or returns hidden states (batch, seq, dim);
        `logits_for` applies where the head is.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:
            seq = h.shape[1] * self.seq_shards
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for name, block in self.layers.items():
            h = block(h, cos, sin, cache=cache, layer_idx=int(name))
        if logits_for is not None and self.output is not None:
            if self.seq_shards > 1:
                raise ValueError("logits_for picks tokens of the whole sequence, but under sequence parallel each "
                                 "rank holds seq / tp of them; run inference without sequence parallel.")
            h = h.flatten(0, 1)[logits_for]
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, non-embedding) parameter counts from the config alone (no model is built).

    Non-embedding means every parameter except the token-embedding table; the output head is counted
    because it does matrix work (with tied embeddings its matrix is counted once, as the head).
    """
    d, f, hd = cfg.dim, cfg.ffn_dim, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.n_kv_heads * hd * 2
    block = attn + 3 * d * f + 2 * d
    if cfg.attention_bias:
        block += (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + d  # q, k, v and output biases
    if cfg.mlp_bias:
        block += 2 * f + d  # w1, w3 and w2 biases
    head = cfg.vocab_size * d
    non_embedding = cfg.n_layers * block + d + head
    total = non_embedding + (0 if cfg.tie_embeddings else cfg.vocab_size * d)
    return total, non_embedding


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token, forward + backward: 6 * N_non_embedding + 12 * layers * dim * seq.

    The second term is attention's score and value products (no causal halving, as in the PaLM paper's
    MFU definition), so MFU is comparable with Megatron's and torchtitan's figures.
    """
    _, non_embedding = parameter_counts(cfg)
    return 6.0 * non_embedding + 12.0 * cfg.n_layers * cfg.dim * seq_len
