"""The heap freeze after a CUDA engine is built (fourfold.infer.gc_freeze): frozen cycles outlive collections until
`thaw`, a freeze made elsewhere is left alone, CPU engines do not freeze, on CUDA a dropped engine's memory
comes back when the next engine is built, and `close` gives it back at once."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from fourfold.errors import ConfigError
from fourfold.infer import gc_freeze
from fourfold.infer.engine import LLMEngine
from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.llm import LLM
from fourfold.infer.requests import SamplingParams
from fourfold.tokenizer import ByteTokenizer
from tests.engine_helpers import tiny_model


class Cycle:
    """An object that refers to itself: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


def test_frozen_cycles_outlive_collections_until_thaw():
    obj = Cycle()
    ref = weakref.ref(obj)
    gc_freeze.freeze()
    try:
        assert gc.get_freeze_count() > 0
        del obj
        gc.collect()
        assert ref() is not None
    finally:
        gc_freeze.thaw()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_thaw_leaves_a_freeze_made_elsewhere():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        gc_freeze.thaw()  # this module froze nothing since its last thaw
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_cpu_engines_do_not_freeze_and_any_build_thaws_the_engines_freeze():
    before = gc.get_freeze_count()
    engine = LLMEngine.from_model(tiny_model(), ByteTokenizer(), EngineConfig(block_size=4, num_kv_blocks=16))
    assert engine.cfg.freeze_gc and gc.get_freeze_count() == before
    gc_freeze.freeze()  # as a CUDA engine's build leaves it
    try:
        assert gc.get_freeze_count() > 0
        LLMEngine.from_model(tiny_model(), ByteTokenizer(),
                             EngineConfig(block_size=4, num_kv_blocks=16, freeze_gc=False))
        assert gc.get_freeze_count() == 0
    finally:
        gc_freeze.thaw()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="only CUDA engines freeze the heap")
def test_a_dropped_cuda_engine_is_freed_when_the_next_one_is_built():
    def build() -> LLMEngine:
        cfg = EngineConfig(block_size=16, gpu_memory_utilization=0.5, cuda_graphs=False, fused_decoder=False)
        return LLMEngine.from_model(tiny_model().float().cuda(), ByteTokenizer(), cfg)

    try:
        first = build()
        assert gc.get_freeze_count() > 0
        blocks, ref = first.runner.pool.num_blocks, weakref.ref(first)
        del first  # its runner holds it in reference cycles, frozen: only a thaw lets the collector free it
        second = build()
        assert ref() is None
        assert second.runner.pool.num_blocks > 0.9 * blocks  # the first pool's memory was given back
    finally:
        gc_freeze.thaw()


def test_close_frees_the_runner_of_a_frozen_engine_that_is_still_referenced():
    engine = LLMEngine.from_model(tiny_model(), ByteTokenizer(), EngineConfig(block_size=4, num_kv_blocks=16))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    runner = weakref.ref(engine.runner)
    gc_freeze.freeze()  # as a CUDA engine's build leaves it
    try:
        engine.close()
        assert runner() is None  # dropped and collected although `engine` itself is alive (its cycles were thawed)
        assert not engine.has_unfinished()
        with pytest.raises(ConfigError, match="closed"):
            engine.add_request("b", [1, 2], SamplingParams(max_tokens=2))
        with pytest.raises(ConfigError, match="closed"):
            engine.step()
        engine.close()  # a second close does nothing
    finally:
        gc_freeze.thaw()


def test_llm_as_a_context_manager_closes_its_engine():
    with LLM(tiny_model(), ByteTokenizer(), device="cpu", block_size=4, num_kv_blocks=16) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0), progress=False)
        assert len(out[0].token_ids) == 3
    assert llm.engine.runner is None
