"""Malformed requests each get an OpenAI-style JSON error with the right 4xx, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")

LONG = "x" * 5000  # more tokens than the tiny model's context (byte tokenizer: one token per byte)


def chat(**fields):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}


def completion(**fields):
    return {"model": "tiny", "prompt": "hi", **fields}


# (name, method, path, body (dict -> JSON, str/bytes -> raw), extra headers, expected status, expected param)
CASES = [
    ("invalid JSON", "POST", "/v1/completions", b"{not json", {}, 400, None),
    ("JSON that is not an object", "POST", "/v1/completions", b"[1, 2]", {}, 400, None),
    ("empty body", "POST", "/v1/chat/completions", b"", {}, 400, None),
    ("missing model", "POST", "/v1/completions", {"prompt": "hi"}, {}, 400, "model"),
    ("missing prompt", "POST", "/v1/completions", {"model": "tiny"}, {}, 400, "prompt"),
    ("missing messages", "POST", "/v1/chat/completions", {"model": "tiny"}, {}, 400, "messages"),
    ("unknown model", "POST", "/v1/completions", {**completion(), "model": "gpt-9"}, {}, 404, "model"),
    ("empty prompt", "POST", "/v1/completions", completion(prompt=""), {}, 400, "prompt"),
    ("empty messages", "POST", "/v1/chat/completions", chat(messages=[]), {}, 400, "messages"),
    ("prompt longer than the context", "POST", "/v1/completions", completion(prompt=LONG), {}, 400, "prompt"),
    ("max_tokens zero", "POST", "/v1/completions", completion(max_tokens=0), {}, 400, "max_tokens"),
    ("max_tokens negative", "POST", "/v1/chat/completions", chat(max_tokens=-5), {}, 400, "max_tokens"),
    ("max_tokens past the context", "POST", "/v1/completions", completion(max_tokens=100000), {}, 400,
     "max_tokens"),
    ("max_completion_tokens zero", "POST", "/v1/chat/completions", chat(max_completion_tokens=0), {}, 400,
     "max_completion_tokens"),
    ("n too large", "POST", "/v1/completions", completion(n=1000), {}, 400, "n"),
    ("n zero", "POST", "/v1/chat/completions", chat(n=0), {}, 400, "n"),
    ("bad role", "POST", "/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "hi"}]), {}, 400,
     "messages.0.role"),
    ("message without content", "POST", "/v1/chat/completions", chat(messages=[{"role": "user"}]), {}, 400,
     "messages.0.content"),
    ("temperature of the wrong type", "POST", "/v1/completions", completion(temperature="hot"), {}, 400,
     "temperature"),
    ("temperature out of range", "POST", "/v1/chat/completions", chat(temperature=7), {}, 400, "temperature"),
    ("top_p zero", "POST", "/v1/completions", completion(top_p=0), {}, 400, "top_p"),
    ("logprobs out of range (completions)", "POST", "/v1/completions", completion(logprobs=50), {}, 400, "logprobs"),
    ("top_logprobs out of range (chat)", "POST", "/v1/chat/completions", chat(logprobs=True, top_logprobs=99), {},
     400, "top_logprobs"),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions", chat(top_logprobs=2), {}, 400,
     "top_logprobs"),
    ("presence_penalty out of range", "POST", "/v1/completions", completion(presence_penalty=5), {}, 400,
     "presence_penalty"),
    ("too many stop strings", "POST", "/v1/completions", completion(stop=["a", "b", "c", "d", "e"]), {}, 400, "stop"),
    ("stream of the wrong type", "POST", "/v1/chat/completions", chat(stream="yes please"), {}, 400, "stream"),
    ("prompt token id out of the vocabulary", "POST", "/v1/completions", completion(prompt=[1, 2, 10**9]), {}, 400,
     "prompt"),
    ("tools are not supported", "POST", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}]), {}, 400, "tools"),
    ("oversized body", "POST", "/v1/completions", completion(prompt="y" * (3 * 1024 * 1024)), {}, 413, None),
    ("unknown route", "GET", "/v1/nothing", None, {}, 404, None),
    ("wrong method", "GET", "/v1/completions", None, {}, 405, None),
]


def test_there_are_at_least_25_kinds():
    assert len({name for name, *_ in CASES}) >= 25


@pytest.mark.parametrize("name, method, path, body, headers, status, param", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_gets_a_json_error_and_the_server_keeps_serving(served, name, method, path, body,
                                                                          headers, status, param):
    with httpx.Client(base_url=served.url, timeout=30) as client:
        if isinstance(body, dict):
            r = client.request(method, path, json=body, headers=headers)
        else:
            r = client.request(method, path, content=body,
                               headers={"Content-Type": "application/json", **headers})
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"] and isinstance(error["type"], str)
        if param is not None:
            assert error["param"] == param, error
        good = client.post("/v1/completions", json=completion(max_tokens=3, temperature=0, ignore_eos=True))
        assert good.status_code == 200, good.text
        assert good.json()["usage"]["completion_tokens"] == 3
