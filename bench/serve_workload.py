"""The serving benchmark's client side: a synthetic workload, Poisson arrivals, and vLLM-style latency metrics.

Request lengths are drawn like ShareGPT's (log-normal, mean ~200 prompt / ~180 output tokens; no dataset
download), optionally with a share of long prompts. Each request streams /v1/chat/completions; the
client stamps every content chunk, and the summary uses vLLM's benchmark names: TTFT (time to first
token), TPOT (time per output token after the first), ITL (inter-token latency, every gap), E2EL
(end-to-end latency), each as mean / median / P99 in ms, plus request, output and total token
throughput and goodput (requests/s meeting every SLO).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass
class Request:
    prompt_tokens: int
    output_tokens: int
    text: str


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def lognormal_lengths(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    mu = math.log(mean) - sigma ** 2 / 2
    return int(min(high, max(low, round(rng.lognormvariate(mu, sigma)))))


def make_workload(n: int, words: list[str], seed: int, long_fraction: float, long_tokens: int,
                  tokens_per_word: float) -> list[Request]:
    """n requests; prompts are random words whose count targets the drawn token length."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        long = rng.random() < long_fraction
        prompt = long_tokens if long else lognormal_lengths(rng, 200, 0.9, 8, 1024)
        output = lognormal_lengths(rng, 180, 0.9, 8, 512)
        text = " ".join(rng.choice(words) for _ in range(max(1, int(prompt / tokens_per_word))))
        out.append(Request(prompt, output, text))
    return out


async def _one(client: httpx.AsyncClient, model: str, req: Request, extra: dict) -> Result:
    body = {"model": model, "messages": [{"role": "user", "content": req.text}], "max_tokens": req.output_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **extra}
    start = time.perf_counter()
    stamps, usage = [], None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return Result(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        stamps.append(time.perf_counter())
    except httpx.HTTPError as e:
        return Result(False, error=f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if not stamps:
        return Result(False, error="no tokens")
    out_tokens = usage["completion_tokens"] if usage else len(stamps)
    prompt_tokens = usage["prompt_tokens"] if usage else req.prompt_tokens
    return Result(True, prompt_tokens, out_tokens, stamps[0] - start, end - start, list(np.diff(stamps)))


async def run_load(url: str, model: str, workload: list[Request], rate: float, seed: int,
                   timeout_s: float = 600, extra: dict | None = None) -> tuple[list[Result], float]:
    """Send the workload with exponential gaps at `rate` requests/s; (results, wall seconds). `extra`: more
    body fields for servers that take them (fourfold's ignore_eos keeps output lengths as drawn)."""
    rng = random.Random(seed + 1)
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=2048)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for req in workload:
            tasks.append(asyncio.create_task(_one(client, model, req, extra or {})))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    a = np.asarray(values) * 1000
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[Result], wall_s: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    good = [r for r in ok if r.ttft * 1000 <= slo_ttft_ms and r.output_tokens > 1
            and (r.e2el - r.ttft) / (r.output_tokens - 1) * 1000 <= slo_tpot_ms]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {"completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if not r.ok})[:3], "duration_s": wall_s,
            "request_throughput": len(ok) / wall_s, "output_throughput": out_tokens / wall_s,
            "total_token_throughput": (in_tokens + out_tokens) / wall_s,
            "goodput": len(good) / wall_s, "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
            "itl_ms": _stats([g for r in ok for g in r.itl]), "e2el_ms": _stats([r.e2el for r in ok])}
