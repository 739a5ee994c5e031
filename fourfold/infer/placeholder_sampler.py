"""TO BE REPLACED by fourfold.infer.sampler (helper gpu): greedy and temperature sampling only, same interface.

    token_ids, logprobs = PlaceholderSampler().sample(logits, params, output_ids)

Temperature 0 rows take the argmax; other rows draw from softmax(logits / temperature) after top-k and
top-p (fourfold.infer.sampling.sample_next), seeded rows from their own generator. No penalties, no
min-p, no logprobs. The engine uses fourfold.infer.sampler.Sampler as soon as it is importable.
"""

from __future__ import annotations

import torch

from fourfold.infer.requests import SamplingParams
from fourfold.infer.sampling import sample_next


class PlaceholderSampler:
    """The minimal sampler the engine uses until the device-side sampler lands."""

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], output_ids: list[list[int]]):
        """(token ids (n,), [None] * n)."""
        out = logits.argmax(dim=-1)
        for i, p in enumerate(params):
            if p.temperature > 0:
                gen = None
                if p.seed is not None:
                    gen = torch.Generator(device=logits.device).manual_seed(p.seed + len(output_ids[i]))
                out[i] = sample_next(logits[i:i + 1], p.temperature, p.top_k, p.top_p, gen)[0]
        return out, [None] * len(params)
