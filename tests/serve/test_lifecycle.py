"""Request timeouts and graceful shutdown: a slow request gets a 504 JSON error; SIGTERM lets in-flight
requests finish before `fourfold serve` exits 0."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from fourfold.serve.app import ServeSettings, build_app  # noqa: E402
from fourfold.serve.server import BackgroundServer  # noqa: E402

SLOW = {"model": "tiny", "prompt": "hi", "max_tokens": 250, "temperature": 0, "ignore_eos": True}


def test_a_request_past_its_timeout_gets_504_and_frees_its_blocks(engine):
    app = build_app(engine, ServeSettings(model_name="tiny", request_timeout_s=0.05))
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post("/v1/completions", json=SLOW)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        streamed = client.post("/v1/completions", json={**SLOW, "stream": True}).text
        assert '"timeout_error"' in streamed and streamed.rstrip().endswith("data: [DONE]")
        for _ in range(100):
            if engine.stats().running == 0:
                break
            time.sleep(0.05)
        assert engine.stats().running == 0 and engine.stats().kv_blocks_used == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_lets_the_running_stream_finish_then_exits_cleanly(model_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fourfold", "serve", "--model", str(model_dir), "--port", str(port),
                             "--served-model-name", "tiny"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        chunks, first = [], threading.Event()

        def stream():
            with httpx.stream("POST", url + "/v1/completions", json={**SLOW, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        chunks.append(line)
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        events = [json.loads(c[6:]) for c in chunks if c.startswith("data: {")]
        assert chunks[-1] == "data: [DONE]"
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert len(events) == SLOW["max_tokens"]  # every token arrived although SIGTERM came after the first
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
