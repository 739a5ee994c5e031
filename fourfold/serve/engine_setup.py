"""Opening the async engine `fourfold serve` runs on: the model loaded once, the engine's batching settings.

Kept apart from the app so tests and benchmarks can build an app around an engine they opened themselves.
"""

from __future__ import annotations

from fourfold.distributed import pick_device
from fourfold.infer.async_engine import AsyncEngine
from fourfold.infer.engine_config import EngineConfig


def open_engine(model: str, *, device: str = "auto", dtype: str = "auto", tp: int = 1,
                config: EngineConfig | None = None) -> AsyncEngine:
    """An AsyncEngine over the model at `model` (a run, checkpoint or imported directory), stepping in a thread."""
    if tp != 1:
        from fourfold.errors import ConfigError

        raise ConfigError("fourfold serve --tp N > 1 runs under torchrun; this build serves one process (--tp 1).")
    return AsyncEngine.from_path(model, pick_device(device, flag="--device"), None if dtype == "auto" else dtype,
                                 config)
