"""Batched sampler: greedy, seeds independent of the batch, truncation never leaks, penalties and logprobs exact."""

from __future__ import annotations

import math

import torch

from fourfold.infer.requests import SamplingParams
from fourfold.infer.sampler import Sampler, apply_penalties

# Probabilities 0.5, 0.3, 0.15, 0.05 and a long tail of impossible-ish tokens.
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
CRAFTED = torch.cat([PROBS.log(), torch.full((12,), -30.0)])


def draws(params: SamplingParams, rows: int = 4000, logits: torch.Tensor = CRAFTED) -> torch.Tensor:
    torch.manual_seed(0)
    batch = logits.unsqueeze(0).expand(rows, -1).clone()
    ids, _ = Sampler().sample(batch, [params] * rows, [[] for _ in range(rows)])
    return ids


def test_greedy_is_argmax_also_next_to_sampled_rows():
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)] * 3
    ids, logprobs = Sampler().sample(logits, params, [[] for _ in range(6)])
    assert ids.dtype == torch.int64 and ids.shape == (6,)
    assert ids[0::2].tolist() == logits[0::2].argmax(-1).tolist()
    assert logprobs == [None] * 6
    only_greedy, _ = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 6, [[] for _ in range(6)])
    assert only_greedy.tolist() == logits.argmax(-1).tolist()


def test_seeded_rows_reproducible_whatever_the_batch():
    torch.manual_seed(1)
    vocab = 64
    target = torch.randn(vocab)
    mine = SamplingParams(temperature=1.0, seed=1234)

    def run(batch_before: int, batch_after: int, others_seed) -> list[int]:
        out: list[int] = []
        for _ in range(20):
            rows = [torch.randn(vocab) for _ in range(batch_before)] + [target] + [torch.randn(vocab) for _ in range(batch_after)]
            params = ([SamplingParams(temperature=0.7, top_k=5, seed=others_seed)] * batch_before + [mine]
                      + [SamplingParams(temperature=1.3)] * batch_after)
            outputs = [[1, 2]] * batch_before + [list(out)] + [[]] * batch_after
            ids, _ = Sampler().sample(torch.stack(rows), params, outputs)
            out.append(ids[batch_before].item())
        return out

    alone = run(0, 0, None)
    assert run(3, 2, 7) == alone
    assert run(1, 5, None) == alone
    assert len(set(alone)) > 3  # really sampled, not greedy
    other_seed = []
    for _ in range(20):
        ids, _ = Sampler().sample(target.unsqueeze(0), [SamplingParams(temperature=1.0, seed=1235)], [list(other_seed)])
        other_seed.append(ids.item())
    assert other_seed != alone


def test_plain_sampling_follows_the_distribution():
    ids = draws(SamplingParams(temperature=1.0), rows=20000)
    freq = torch.bincount(ids, minlength=16).float() / ids.numel()
    assert torch.allclose(freq[:4], PROBS, atol=0.015)
    assert freq[4:].sum() < 1e-3


def test_top_k_never_picks_an_excluded_token():
    ids = draws(SamplingParams(temperature=1.0, top_k=2))
    assert set(ids.tolist()) == {0, 1}
    freq = torch.bincount(ids, minlength=2).float() / ids.numel()
    assert abs(freq[0].item() - 0.5 / 0.8) < 0.03


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.8)).tolist()) == {0, 1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.81)).tolist()) == {0, 1, 2}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.01)).tolist()) == {0}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.2)).tolist()) == {0, 1, 2}  # threshold 0.1
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.7)).tolist()) == {0}  # threshold 0.35


def test_each_row_honours_its_own_truncation():
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.8),
              SamplingParams(temperature=1.0, min_p=0.2), SamplingParams(temperature=1.0)]
    rows = 1200
    batch = CRAFTED.unsqueeze(0).expand(rows * 4, -1).clone()
    torch.manual_seed(0)
    ids, _ = Sampler().sample(batch, params * rows, [[] for _ in range(rows * 4)])
    picked = [set(ids[i::4].tolist()) for i in range(4)]
    assert picked == [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}]


def test_penalties_match_a_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, 1.0, 1.0, 1.0], [0.1, 0.2, 0.3, 0.4, 0.5]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams(frequency_penalty=-1.0),
              SamplingParams()]
    outputs = [[0, 1, 1, 4], [2, 2, 2], [0, 1, 2]]
    got = apply_penalties(logits, params, outputs)
    expected = torch.tensor([
        # token 0 (count 1, positive): 2/2 - 0.5 - 0.25; token 1 (count 2, negative): -1*2 - 1 - 0.25;
        # token 4 (count 1, negative): -2*2 - 0.5 - 0.25; tokens 2 and 3 unseen.
        [2.0 / 2 - 0.5 - 0.25, -1.0 * 2 - 2 * 0.5 - 0.25, 0.5, 3.0, -2.0 * 2 - 0.5 - 0.25],
        [1.0, 1.0, 1.0 + 3.0, 1.0, 1.0],
        [0.1, 0.2, 0.3, 0.4, 0.5]])
    assert torch.allclose(got, expected)
    assert torch.equal(logits[2], torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5]))  # input untouched
    ids, _ = Sampler().sample(logits, [SamplingParams(temperature=0.0, frequency_penalty=2.0)] * 3,
                              [[3], [], [4]])
    assert ids.tolist() == [0, 0, 3]  # greedy sees the penalised logits


def test_logprobs_are_log_softmax_of_the_raw_logits():
    torch.manual_seed(2)
    logits = torch.randn(3, 40, dtype=torch.bfloat16)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.9, seed=5, logprobs=0),
              SamplingParams(temperature=0.0)]
    ids, logprobs = Sampler().sample(logits, params, [[], [7], []])
    reference = logits.float().log_softmax(-1)
    first = logprobs[0]
    assert first.token_id == ids[0].item() and math.isclose(first.logprob, reference[0, ids[0]].item(), rel_tol=1e-6)
    top_values, top_ids = reference[0].topk(3)
    assert [t for t, _ in first.top] == top_ids.tolist()
    assert all(math.isclose(v, r, rel_tol=1e-6) for (_, v), r in zip(first.top, top_values.tolist()))
    second = logprobs[1]
    assert second.top == [] and math.isclose(second.logprob, reference[1, ids[1]].item(), rel_tol=1e-6)
    assert logprobs[2] is None
