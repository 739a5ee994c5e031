"""The async streaming API: streamed deltas add up to the offline engine's output; abort frees the blocks;
a consumer that stops early aborts its request; bad requests raise at once."""

import asyncio

import pytest

from fourfold.errors import ConfigError
from fourfold.infer.async_engine import AsyncEngine
from fourfold.infer.requests import SamplingParams
from tests.engine_helpers import GREEDY, Twin, run_to_end

PROMPTS = {"a": [3, 14, 15, 9, 26], "b": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], "c": [7]}


@pytest.fixture(scope="module")
def twin():
    return Twin()


async def collect(engine, rid, prompt, params):
    outs = []
    async for out in engine.generate(rid, prompt, params):
        outs.append(out)
    return outs


def test_streaming_equals_offline(twin):
    offline, steps = run_to_end(twin.engine(), {rid: (p, GREEDY) for rid, p in PROMPTS.items()})
    offline_text = {rid: "" for rid in PROMPTS}
    for outs in steps:
        for o in outs:
            offline_text[o.request_id] += o.text_delta
    engine = AsyncEngine(twin.engine(max_num_batched_tokens=4))

    async def main():
        return await asyncio.gather(*(collect(engine, rid, p, GREEDY) for rid, p in PROMPTS.items()))

    try:
        streams = dict(zip(PROMPTS, asyncio.run(main())))
    finally:
        engine.shutdown()
    for rid, outs in streams.items():
        assert [t for o in outs for t in o.token_ids] == offline[rid]
        assert "".join(o.text_delta for o in outs) == offline_text[rid]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == "length" and outs[0].ttft_s is not None
    assert engine.stats().kv_blocks_used <= engine.stats().kv_blocks_total
    assert all(r == 0 for r in engine.engine.blocks.ref_counts)


def test_abort_and_early_exit_free_blocks(twin):
    engine = AsyncEngine(twin.engine())
    long = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)

    async def main():
        stream = engine.generate("x", PROMPTS["b"], long)
        first = await stream.__anext__()
        await engine.abort("x")
        rest = [o async for o in stream]
        async for _ in engine.generate("y", PROMPTS["a"], long):
            break  # a client that goes away
        await asyncio.sleep(0.05)
        return first, rest

    try:
        first, rest = asyncio.run(main())
        for _ in range(100):
            if not engine.engine.has_unfinished():
                break
            asyncio.run(asyncio.sleep(0.01))
    finally:
        engine.shutdown()
    assert not first.finished and rest[-1].finish_reason == "abort"
    assert len(first.token_ids) + sum(len(o.token_ids) for o in rest) < 50
    assert all(r == 0 for r in engine.engine.blocks.ref_counts)
    assert engine.stats().running == engine.stats().waiting == 0


def test_bad_requests_raise_at_once(twin):
    engine = AsyncEngine(twin.engine(num_kv_blocks=2))

    async def main():
        with pytest.raises(ConfigError, match="KV-cache blocks"):
            await collect(engine, "big", list(range(20)), GREEDY)
        with pytest.raises(ConfigError, match="temperature"):
            await collect(engine, "t", [1], SamplingParams(temperature=-1))

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert engine.model_name == "fourfold" and engine.max_model_len == 64
