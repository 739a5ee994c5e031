"""The real `openai` client against `fourfold serve`: greedy text equals the engine's offline generate."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

PROMPTS = ["def f(x):", "The quick brown fox"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_whole_and_streamed_equal_offline_greedy(served, client, prompt):
    expected = served.offline_text(prompt, max_tokens=12)
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text == expected
    assert whole.usage.prompt_tokens == len(served.tokenizer.encode(prompt))
    assert whole.usage.completion_tokens == len(served.offline_ids(prompt, max_tokens=12))
    pieces = [c.choices[0].text for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                                                      temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == expected
    assert len(pieces) > 1  # it really streamed


def test_chat_whole_and_streamed_equal_offline_greedy(served, client):
    prompt = served.chat_template.render(MESSAGES, add_generation_prompt=True)
    expected = served.offline_text(prompt, max_tokens=10)
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_n_choices_with_a_seed_are_reproducible(client):
    kwargs = dict(model="tiny", prompt="abc", max_tokens=8, temperature=1.0, n=3, seed=7, extra_body={"ignore_eos": True})
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert first.usage.completion_tokens == 24


def test_stop_string_cuts_the_output(served, client):
    full = served.offline_text("hello", max_tokens=16)
    assert len(full) >= 5
    stop = full[3:5]
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=16, temperature=0, stop=[stop])
    assert out.choices[0].text == full[:full.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_logprobs_come_back_for_every_token(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-5  # greedy picks the most likely token


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
