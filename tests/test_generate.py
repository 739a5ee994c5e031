"""Generation: the KV-cached forward equals the full forward; sampling options behave as documented."""

import torch

from fourfold.config import build_config
from fourfold.infer.generate import SamplingOptions, generate
from fourfold.infer.kv_cache import KVCache, cached_forward
from fourfold.infer.sampling import sample_next
from fourfold.models.llama import Llama


def tiny_model():
    torch.manual_seed(0)
    cfg = build_config({"model": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                                      max_seq_len=64), "train": {"seq_len": 32}}).model
    return Llama(cfg).double().eval()


def test_cached_forward_matches_full_forward():
    model = tiny_model()
    tokens = torch.randint(0, 64, (2, 12))
    cache = KVCache(model, 2, 20, "cpu", torch.float64)
    got = [cached_forward(model, tokens[:, :5], cache, 0)]
    for pos in range(5, 12):
        got.append(cached_forward(model, tokens[:, pos:pos + 1], cache, pos))
    full = model(tokens)
    for i, logits in enumerate(got):
        torch.testing.assert_close(logits, full[:, 4 + i], rtol=1e-10, atol=1e-10)


def test_greedy_generation_equals_recomputing_everything():
    model = tiny_model()
    prompt = [1, 2, 3, 4]
    out = generate(model, prompt, SamplingOptions(max_new_tokens=10, temperature=0.0), torch.device("cpu"))
    seq = list(prompt)
    for _ in range(10):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert out == seq[len(prompt):]


def test_sampling_options():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    gen = torch.Generator().manual_seed(0)
    assert int(sample_next(logits, temperature=0.0)) == 1
    assert all(int(sample_next(logits, 1.0, top_k=1, generator=gen)) == 1 for _ in range(20))
    assert all(int(sample_next(logits, 1.0, top_p=0.01, generator=gen)) == 1 for _ in range(20))
    draws = {int(sample_next(logits, 1.0, top_k=2, generator=gen)) for _ in range(200)}
    assert draws == {1, 3}


def test_generation_stops_at_eos_and_is_seeded():
    model = tiny_model()
    opts = SamplingOptions(max_new_tokens=30, temperature=1.0, top_k=0, top_p=1.0, seed=3)
    a = generate(model, [5, 6], opts, torch.device("cpu"))
    b = generate(model, [5, 6], opts, torch.device("cpu"))
    assert a == b and len(a) == 30
    eos = a[3]
    c = generate(model, [5, 6], opts, torch.device("cpu"), eos_id=eos)
    assert c[-1] == eos and len(c) == a.index(eos) + 1
