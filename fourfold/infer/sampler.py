"""Batched next-token sampling on the logits' device: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

One call picks one token for every row of a step's logits, each row with its own `SamplingParams`:

    sampler = Sampler()
    token_ids, logprobs = sampler.sample(logits, params, output_ids)
    # logits (n, vocab) any float dtype, on any device; params: list of n SamplingParams;
    # output_ids: list of n lists, the tokens each request has generated so far (prompt excluded).
    # token_ids: int64 tensor (n,) on the logits' device;
    # logprobs: list of n entries, None where params[i].logprobs is None, else a TokenLogprobs.

What happens to each row, in this order (every step vectorised over the batch, no loop over rows
except to seed the noise of seeded rows):
1. penalties over the row's generated tokens: HF's repetition penalty (a seen token's logit is divided
   by the penalty when positive, multiplied when negative), then OpenAI's frequency and presence
   penalties (logit -= frequency * count + presence * [count > 0]);
2. temperature 0 rows take the argmax of the penalised logits (greedy);
3. other rows divide by the temperature, keep the top_k most likely tokens, then the smallest set whose
   probability reaches top_p, then drop tokens less likely than min_p times the most likely one
   (each threshold computed on what the previous one kept), and draw from what remains.

Drawing uses the exponential race (the argmax of probs / E with E ~ Exp(1) is a draw from probs), so
every row's noise is an independent tensor. A row with a seed gets its noise from a generator seeded by
(seed, number of tokens generated so far): the same request gives the same tokens whatever else is in
the batch, and again after preemption and recomputation (on one device type: CPU and CUDA generators
differ). Rows without a seed share the sampler's generator.

Logprobs are those of the model's own distribution: log_softmax of the raw logits in float32, before
penalties, temperature and truncation (the chosen token's, and the `logprobs` most likely tokens').
Stop tokens, stop strings and max_tokens are the engine's job.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from fourfold.infer.argmax_gpu import argmax_rows
from fourfold.infer.argmax_gpu import available as argmax_gpu_runs
from fourfold.infer.requests import SamplingParams, TokenLogprobs

_MASK64 = (1 << 64) - 1


def row_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (request seed, step): splitmix64 of the pair, so nearby seeds diverge."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def distinct(params: Sequence[SamplingParams]) -> list[SamplingParams]:
    """The different SamplingParams objects of a batch (requests often share one): checks run over these."""
    return list({id(p): p for p in params}.values())


def penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def plain_greedy(params: Sequence[SamplingParams]) -> bool:
    """Whether every row just takes its argmax: temperature 0, no penalties, no logprobs (then a decode graph's
    own argmax, ModelRunner.forward_greedy, gives the same tokens as `Sampler.sample`)."""
    return all(p.temperature == 0 and not penalised(p) and p.logprobs is None for p in distinct(params))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's first maximum: on CUDA fourfold.infer.argmax_gpu's kernel where it runs, on CPU
    through `max` (the same index as argmax, three times faster there)."""
    if logits.is_cuda:
        return argmax_rows(logits) if argmax_gpu_runs(logits) else logits.argmax(dim=-1)
    return logits.max(dim=-1).indices


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    output_ids: Sequence[Sequence[int]], kinds: Optional[list[SamplingParams]] = None) -> torch.Tensor:
    """Float32 logits with repetition (HF), then frequency and presence (OpenAI) penalties applied.

    The input is never modified: a new tensor when a row is penalised (or the input was not float32),
    else the input itself.
    """
    if not any(penalised(p) for p in (kinds if kinds is not None else distinct(params))):
        return logits.float()
    rows = [i for i, p in enumerate(params) if output_ids[i] and penalised(p)]
    if not rows:
        return logits.float()
    logits = logits.float().clone()
    device, vocab = logits.device, logits.shape[-1]
    longest = max(len(output_ids[i]) for i in rows)
    ids = torch.full((len(rows), longest), vocab, dtype=torch.long)  # index `vocab` is a dropped pad column
    for r, i in enumerate(rows):
        ids[r, :len(output_ids[i])] = torch.as_tensor(output_ids[i], dtype=torch.long)
    ids = ids.to(device, non_blocking=True)
    counts = torch.zeros(len(rows), vocab + 1, device=device).scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    counts = counts[:, :vocab]
    seen = counts > 0
    values = torch.tensor([[params[i].repetition_penalty, params[i].frequency_penalty, params[i].presence_penalty]
                           for i in rows], dtype=torch.float32).to(device, non_blocking=True)
    rep, freq, pres = values[:, 0:1], values[:, 1:2], values[:, 2:3]
    index = torch.tensor(rows, device=device)
    sub = logits.index_select(0, index)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * counts - pres * seen.float()
    logits.index_copy_(0, index, sub)
    return logits


def truncation_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                    sort: bool = True, use_min_p: bool = True) -> torch.Tensor:
    """Boolean (n, vocab), True where a token is dropped by top_k (0 = off), top_p (1 = off) or min_p (0 = off).

    `logits` are already divided by the temperature; each threshold sees only what the previous kept.
    `sort` / `use_min_p` False skip top-k/top-p / min-p when the caller knows no row uses them (no device sync).
    """
    n, vocab = logits.shape
    drop = torch.zeros_like(logits, dtype=torch.bool)
    if sort:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device).expand(n, vocab)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
        sorted_drop = rank >= k
        probs = sorted_logits.masked_fill(sorted_drop, float("-inf")).softmax(dim=-1)
        # A token goes when the mass of the more likely tokens already reaches top_p (the first always stays).
        sorted_drop |= ((probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        sorted_drop[:, 0] = False
        drop = drop.scatter(1, order, sorted_drop)
    if use_min_p:
        probs = logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        drop |= probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return drop


class Sampler:
    """Picks the next token for each row of a batch; holds only the generator that unseeded rows share."""

    def __init__(self, generator: Optional[torch.Generator] = None):
        self.generator = generator
        """Noise for rows without a seed, on the logits' device (None: torch's default generator there)."""

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               output_ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[Optional[TokenLogprobs]]]:
        """(token ids (n,) int64 on the logits' device, one TokenLogprobs or None per row); see the module doc."""
        n = logits.shape[0]
        assert len(params) == n and len(output_ids) == n, "one SamplingParams and one output list per row"
        kinds = distinct(params)
        greedy_only = all(p.temperature == 0 for p in kinds)
        penalised = apply_penalties(logits, params, output_ids, kinds)
        if greedy_only:
            token_ids = greedy_argmax(penalised)
        else:
            token_ids = self._draw(penalised, params, output_ids)
        if all(p.logprobs is None for p in kinds):
            return token_ids, [None] * n
        return token_ids, self._logprobs(logits, token_ids, params)

    def _draw(self, logits: torch.Tensor, params: Sequence[SamplingParams],
              output_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        device = logits.device
        columns = torch.tensor([[p.temperature, p.top_k, p.top_p, p.min_p] for p in params],
                               dtype=torch.float32).to(device, non_blocking=True)
        temperature, top_k, top_p, min_p = columns.unbind(1)
        greedy = temperature == 0
        scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
        vocab = logits.shape[-1]
        sort = any(p.temperature > 0 and (0 < p.top_k < vocab or p.top_p < 1) for p in params)
        use_min_p = any(p.temperature > 0 and p.min_p > 0 for p in params)
        drop = truncation_mask(scaled, top_k.long(), top_p, min_p, sort=sort, use_min_p=use_min_p)
        probs = scaled.masked_fill(drop, float("-inf")).softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, p in enumerate(params):
            if p.seed is not None and p.temperature > 0:
                g = torch.Generator(device=device)
                g.manual_seed(row_seed(p.seed, len(output_ids[i])))
                noise[i].exponential_(generator=g)
        drawn = (probs / noise.clamp_min(1e-30)).argmax(dim=-1)
        return torch.where(greedy, greedy_argmax(logits), drawn)

    @staticmethod
    def _logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                  params: Sequence[SamplingParams]) -> list[Optional[TokenLogprobs]]:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        out: list[Optional[TokenLogprobs]] = [None] * len(params)
        if not rows:
            return out
        index = torch.tensor(rows, device=logits.device)
        logp = logits.index_select(0, index).float().log_softmax(dim=-1)
        chosen = logp.gather(1, token_ids.index_select(0, index).unsqueeze(1)).squeeze(1)
        width = max(params[i].logprobs for i in rows)
        top = logp.topk(width, dim=-1) if width > 0 else None
        chosen_list = chosen.tolist()
        ids_list = token_ids.index_select(0, index).tolist()
        top_values = top.values.tolist() if top is not None else [[] for _ in rows]
        top_ids = top.indices.tolist() if top is not None else [[] for _ in rows]
        for r, i in enumerate(rows):
            k = params[i].logprobs
            out[i] = TokenLogprobs(token_id=ids_list[r], logprob=chosen_list[r],
                                   top=list(zip(top_ids[r][:k], top_values[r][:k])))
        return out
