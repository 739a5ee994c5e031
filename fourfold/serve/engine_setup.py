"""Opening the engine `fourfold serve` runs on: one process, or tensor- or pipeline-parallel ranks kept in lockstep.

    engine = open_engine("runs/tiny", config=EngineConfig())      # an AsyncEngine stepping in a thread

Under torchrun with WORLD_SIZE = tp > 1 every rank loads only its shards (fourfold.infer.loading with a tp
mesh); rank 0 gets the AsyncEngine that serves HTTP and sends each step's commands to the others
(fourfold.infer.lockstep), which `open_engine` keeps inside `follow` until rank 0 shuts down (it returns
None there). With WORLD_SIZE = pp > 1 every rank loads only its pipeline stage and runs the micro-batched
pipeline engine (fourfold.infer.pipeline_engine; EngineConfig.pipeline_micro_batching off: one step in flight).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fourfold.distributed import init_distributed, pick_device, shutdown, world_from_env
from fourfold.errors import ConfigError
from fourfold.infer.async_engine import AsyncEngine
from fourfold.infer.engine import LLMEngine
from fourfold.infer.engine_config import EngineConfig
from fourfold.infer.loading import load_model
from fourfold.infer.lockstep import CommandChannel, follow
from fourfold.infer.pipeline_engine import open_pipeline_engine


def open_engine(model: str, *, device: str = "auto", dtype: str = "auto", tp: int = 1, pp: int = 1,
                config: EngineConfig | None = None) -> AsyncEngine | None:
    """An AsyncEngine over the model at `model` (a run, checkpoint or imported directory); None on follower ranks."""
    dtype = None if dtype == "auto" else dtype
    if tp == 1 and pp == 1:
        return AsyncEngine.from_path(model, pick_device(device, flag="--device"), dtype, config)
    if tp > 1 and pp > 1:
        raise ConfigError(f"--tp {tp} with --pp {pp}: serving does not combine tensor and pipeline parallelism "
                          "yet; pass only one of them.")
    ranks, flag = max(tp, pp), "--tp" if tp > 1 else "--pp"
    rank, world, _ = world_from_env()
    if world != ranks:
        raise ConfigError(f"{flag} {ranks} needs {ranks} processes; `fourfold serve {flag} {ranks}` starts them with "
                          f"torchrun, but this is process {rank} of {world}.")
    env = init_distributed(device)
    if pp > 1:
        loaded = load_model(model, env.device, dtype, pp=(env.rank, pp))
        engine = open_pipeline_engine(loaded.model, loaded.tokenizer, config, env.device, loaded.kv_heads,
                                      list(range(pp)), dist.group.WORLD, sampling_seed=0, eos_id=loaded.eos_id,
                                      model_name=loaded.name, chat_template=loaded.chat_template)
    else:
        mesh = init_device_mesh(env.device.type, (tp,), mesh_dim_names=("tp",))
        loaded = load_model(model, env.device, dtype, tp_mesh=mesh)
        engine = LLMEngine.from_model(loaded.model, loaded.tokenizer, config, env.device, loaded.kv_heads,
                                      group=dist.group.WORLD, sampling_seed=0, eos_id=loaded.eos_id,
                                      model_name=loaded.name, chat_template=loaded.chat_template)
    channel = CommandChannel(dist.group.WORLD, env.device)
    if env.rank == 0:
        return AsyncEngine(engine, channel)
    try:
        follow(engine, channel)
    finally:
        shutdown()
    return None
