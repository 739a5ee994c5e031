"""`fourfold serve --tp 2`: two gloo ranks (started by the command through torchrun) each hold half the heads
and step in lockstep; the openai client gets the same greedy text as one process, streamed and whole, and
an aborted stream leaves both ranks in step for the next request."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_tensor_parallel_ranks_serve_the_one_process_greedy_text(served, model_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fourfold", "serve", "--model", str(model_dir), "--tp", "2",
                             "--port", str(port), "--served-model-name", "tiny", "--dtype", "fp32"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt in ["def f(x):", "The quick brown fox"]:
            expected = served.offline_text(prompt, max_tokens=10)
            whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0)
            assert whole.choices[0].text == expected
            stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices) == expected
        with httpx.stream("POST", url + "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 200,
                                                                  "ignore_eos": True, "stream": True}) as r:
            next(r.iter_lines())  # leave after the first event: rank 0 aborts, rank 1 follows
        again = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=10, temperature=0)
        assert again.choices[0].text == served.offline_text("def f(x):", max_tokens=10)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
