"""One tiny random model, one async engine and one server (127.0.0.1, a free port) shared by the serve tests.

`served.offline_text(prompt, max_tokens)` is the engine's own offline greedy output (fourfold.infer.llm.LLM),
the reference every HTTP path must reproduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")

from fourfold.infer.async_engine import AsyncEngine  # noqa: E402
from fourfold.infer.engine_config import EngineConfig  # noqa: E402
from fourfold.infer.llm import LLM  # noqa: E402
from fourfold.infer.requests import SamplingParams  # noqa: E402
from fourfold.serve.app import ServeSettings, build_app  # noqa: E402
from fourfold.serve.server import BackgroundServer  # noqa: E402
from fourfold.checkpoint.store import save_checkpoint  # noqa: E402
from fourfold.models.llama import Llama  # noqa: E402
from fourfold.testing.runs import tiny_config  # noqa: E402

ENGINE = dict(block_size=4, max_num_seqs=16, max_num_batched_tokens=64, kv_cache_bytes=8 << 20)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A run directory holding one checkpoint of a tiny random Llama (byte tokenizer, 256-token context)."""
    import torch

    tmp = tmp_path_factory.mktemp("served-model")
    cfg = tiny_config(tmp, **{"model.max_seq_len": 256})
    torch.manual_seed(0)
    model = Llama(cfg.model)
    save_checkpoint(tmp / "run", 0, model, None, {"config": cfg.to_dict()}, keep=1, writer=True)
    return tmp / "run"


@pytest.fixture(scope="session")
def engine(model_dir):
    engine = AsyncEngine.from_path(model_dir, "cpu", config=EngineConfig(**ENGINE))
    yield engine
    engine.shutdown()


@dataclass
class Served:
    url: str
    tokenizer: object
    chat_template: object
    llm: LLM

    def offline_ids(self, prompt: str, max_tokens: int) -> list[int]:
        return self.llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0].token_ids

    def offline_text(self, prompt: str, max_tokens: int) -> str:
        return self.llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0].text


@pytest.fixture(scope="session")
def served(engine, model_dir):
    llm = LLM(model_dir, config=EngineConfig(**ENGINE))
    with BackgroundServer(build_app(engine, ServeSettings(model_name="tiny"))) as server:
        yield Served(server.url, engine.tokenizer, engine.chat_template, llm)
