"""API keys (401 without the right one), a full server (429 with Retry-After), /health, /metrics and the page."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("fastapi")

from fourfold.serve.app import ServeSettings, build_app  # noqa: E402
from fourfold.serve.server import BackgroundServer  # noqa: E402

BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def keyed(engine):
    with BackgroundServer(build_app(engine, ServeSettings(model_name="tiny", api_key="s3cret"))) as server:
        yield server


@pytest.mark.parametrize("header, status", [(None, 401), ("Bearer wrong", 401), ("s3cret", 401),
                                            ("Bearer s3cret", 200)])
def test_api_key_is_required_everywhere_but_health(keyed, header, status):
    headers = {"Authorization": header} if header else {}
    with httpx.Client(base_url=keyed.url, headers=headers, timeout=30) as client:
        assert client.post("/v1/completions", json=BODY).status_code == status
        assert client.get("/v1/models").status_code == status
        assert client.get("/metrics").status_code == status
        assert client.get("/health").status_code == 200
        if status == 401:
            assert client.post("/v1/completions", json=BODY).json()["error"]["code"] == "invalid_api_key"


def test_a_full_server_answers_429_with_retry_after(engine):
    app = build_app(engine, ServeSettings(model_name="tiny", max_requests_in_flight=2))

    async def burst(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            body = {**BODY, "max_tokens": 40, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(8)))

    with BackgroundServer(app) as server:
        answers = asyncio.run(burst(server.url))
        statuses = sorted(r.status_code for r in answers)
        assert 200 in statuses and 429 in statuses, statuses
        limited = next(r for r in answers if r.status_code == 429)
        assert limited.headers["Retry-After"] == "1"
        assert limited.json()["error"]["type"] == "rate_limit_error"
        with httpx.Client(base_url=server.url, timeout=30) as client:  # and it recovers
            assert client.post("/v1/completions", json=BODY).status_code == 200


def test_health_metrics_and_page(served):
    with httpx.Client(base_url=served.url, timeout=30) as client:
        assert client.get("/health").json() == {"status": "ok"}
        client.post("/v1/completions", json=BODY)
        text = client.get("/metrics").text
        for name in ("fourfold_num_requests_running", "fourfold_num_requests_waiting", "fourfold_kv_blocks_used",
                     "fourfold_prefix_cache_hit_rate", "fourfold_generation_tokens_total",
                     "fourfold_time_to_first_token_seconds_bucket", "fourfold_inter_token_latency_seconds_bucket",
                     "fourfold_e2e_request_latency_seconds_bucket"):
            assert name in text, name
        page = client.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "/v1/chat/completions" in page.text and "<script" in page.text
        assert 'src="http' not in page.text and 'href="http' not in page.text  # no CDN: works offline
