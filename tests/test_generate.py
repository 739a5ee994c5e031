"""Generation: the model's forward with a KV cache equals the full forward and Hugging Face's greedy output,
ragged batches equal each prompt alone; sampling options behave as documented."""

import torch

from fourfold.config import build_config
from fourfold.infer.generate import SamplingOptions, generate, generate_batch
from fourfold.infer.kv_cache import KVCache
from fourfold.infer.sampling import sample_next
from fourfold.models.llama import Llama
from tests.test_model import hugging_face_twin

GREEDY = SamplingOptions(max_new_tokens=10, temperature=0.0)
CPU = torch.device("cpu")


def tiny_model():
    torch.manual_seed(0)
    cfg = build_config({"model": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                                      max_seq_len=64), "train": {"seq_len": 32}}).model
    return Llama(cfg).double().eval()


def cached_step(model, cache, tokens, positions):
    """Logits (batch, vocab) of the last token of each row, through the model's forward with `cache`."""
    b, s = tokens.shape
    last = torch.arange(b) * s + s - 1
    return model(tokens, positions, cache=cache.step(positions), logits_for=last)


def test_cached_forward_matches_full_forward():
    model = tiny_model()
    tokens = torch.randint(0, 64, (2, 12))
    cache = KVCache(len(model.layers), 2, 20)
    got = [cached_step(model, cache, tokens[:, :5], torch.arange(5))]
    for pos in range(5, 12):
        got.append(cached_step(model, cache, tokens[:, pos:pos + 1], torch.tensor([pos])))
    full = model(tokens)
    for i, logits in enumerate(got):
        torch.testing.assert_close(logits, full[:, 4 + i], rtol=1e-10, atol=1e-10)


def test_ragged_batch_gives_each_prompt_the_logits_it_gets_alone():
    model = tiny_model()
    prompts = [torch.randint(0, 64, (3,)), torch.randint(0, 64, (7,))]
    continuation = torch.randint(0, 64, (2, 4))  # the same fed tokens for every run
    tokens = torch.zeros(2, 7, dtype=torch.long)
    tokens[0, :3], tokens[1] = prompts[0], prompts[1]  # row 0 right-padded
    cache = KVCache(len(model.layers), 2, 16)
    positions = torch.arange(7).expand(2, 7)
    together = [model(tokens, positions, cache=cache.step(positions), logits_for=torch.tensor([2, 7 + 6]))]
    for step in range(4):
        positions = torch.tensor([[3 + step], [7 + step]])
        together.append(cached_step(model, cache, continuation[:, step:step + 1], positions))
    for row, prompt in enumerate(prompts):
        alone = KVCache(len(model.layers), 1, 16)
        n = len(prompt)
        logits = [cached_step(model, alone, prompt[None], torch.arange(n))]
        for step in range(4):
            logits.append(cached_step(model, alone, continuation[row:row + 1, step:step + 1],
                                      torch.tensor([n + step])))
        for got, want in zip(together, logits):
            torch.testing.assert_close(got[row], want[0], rtol=1e-10, atol=1e-12)


def test_ragged_batch_generates_what_each_prompt_generates_alone():
    model = tiny_model()
    prompts = [[5], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7]]
    together = generate_batch(model, prompts, GREEDY, CPU)
    assert together == [generate(model, p, GREEDY, CPU) for p in prompts]
    assert all(len(out) == GREEDY.max_new_tokens for out in together)


def test_greedy_generation_equals_hugging_face():
    model = tiny_model()
    hf = hugging_face_twin(model)
    prompt = [3, 14, 15, 9, 26]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert len(expected) == 12
    assert generate(model, prompt, SamplingOptions(max_new_tokens=12, temperature=0.0), CPU) == expected


def test_greedy_generation_equals_recomputing_everything():
    model = tiny_model()
    prompt = [1, 2, 3, 4]
    out = generate(model, prompt, GREEDY, CPU)
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
